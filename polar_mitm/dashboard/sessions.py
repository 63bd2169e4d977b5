"""The Sessions page's table: one row per harness session of every stage, paged, sorted and filtered server-side.

A stage's rows are built from its records' small columns only (ids, `seq`, times, finish reason, weight version,
token counts — never prompts) summed up per session by Arrow's group-by, joined with what the rollout said of each
session (rewards.parquet — with its `end` where the run wrote one —, or sessions.jsonl while it runs, or the
service's results) and what a judge said of it (ROLLOUT/judgments/: its mode and score). The table is kept per stage
and rebuilt only when that stage's files change (their mtimes and sizes), so paging through 100k calls reads
nothing twice. Text search reads the prompt and answer columns on demand and keeps its last answers.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from polar_mitm.dashboard.run_files import Stage, read_json, read_json_lines, stages, watched_stage
from polar_mitm.storage.judgments import JUDGMENTS_DIR, Judgment, read_judgments
from polar_mitm.storage.location import StorageError
from polar_mitm.storage.records import RECORD_SCHEMA, Source, list_sources
from polar_mitm.storage.rewards import read_rewards_table
from polar_mitm.storage.run_layout import REWARDS_FILE, RUN_RECORD, SERVICE_RESULTS_FILE, SESSIONS_FILE

log = logging.getLogger(__name__)

RECORD_COLUMNS = (
    "session_id",
    "task_id",
    "seq",
    "started_at",
    "finished_at",
    "finish_reason",
    "weight_version",
    "prompt_tokens",
    "completion_tokens",
    "error",
    "provider",
    "version_spans",  # a push that landed mid-call: the versions after the first
)
TEXT_COLUMNS = ("request_json", "messages_json", "response_json")
SESSION_SCHEMA = pa.schema(
    [
        ("stage", pa.string()),
        ("kind", pa.string()),  # iteration | evaluation | service
        ("iteration", pa.int64()),
        ("session_id", pa.string()),
        ("task_id", pa.string()),
        ("harness", pa.string()),
        ("status", pa.string()),
        ("finish_reason", pa.string()),  # of the last call
        ("end", pa.string()),  # how the session ended (the rewards' `end`: completed, unparsed_tool_call, …)
        ("reward", pa.float64()),  # what trains: the judged reward where a judge scored the session
        ("outcome", pa.float64()),  # the check's reward before the judge (judged sessions only)
        ("judge_score", pa.float64()),  # the judge's normalised score
        ("judge_mode", pa.string()),  # rubric | group | reference
        ("calls", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("errors", pa.int64()),
        ("started_at", pa.float64()),  # epoch seconds
        ("finished_at", pa.float64()),
        ("init_seconds", pa.float64()),
        ("run_seconds", pa.float64()),
        ("eval_seconds", pa.float64()),
        ("weight_versions", pa.string()),  # the distinct versions that sampled its calls, joined by ","
    ]
)
SORTABLE = tuple(SESSION_SCHEMA.names)
FILTERS = ("stage", "kind", "task_id", "harness", "status", "end", "finish_reason", "judge_mode")
MAX_PAGE = 500
SEARCHES_KEPT = 32


@dataclass
class SessionQuery:
    """A page of the table: filters (exact values), a text search, one sort column, offset and limit."""

    filters: dict[str, str]
    text: str = ""
    sort: str = "started_at"
    descending: bool = False
    offset: int = 0
    limit: int = 50


def record_tables(stage: Stage, columns: tuple[str, ...]) -> list[pa.Table]:
    """The stage's records (shards and live journals), `columns` of them; unreadable parts skipped, logged."""
    if not stage.flows_dir.is_dir():
        return []
    found = list_sources([stage.flows_dir])
    tables = []
    for source in found.sources:
        try:
            present = source_columns(source)
            tables.append(source.read([c for c in columns if c in present]))
        except (StorageError, OSError, pa.ArrowException) as exc:
            log.warning("%s (skipped)", exc)
    return tables


def source_columns(source: Source) -> set[str]:
    """Every column a record source holds (its footer's schema; `Source.columns` is only what merge reads)."""
    if source.table is not None:
        return set(source.table.column_names)
    return set(pq.read_schema(source.name, filesystem=source.filesystem).names)


def per_session_records(stage: Stage) -> dict[str, dict[str, Any]]:
    """Per session: its calls summed up (count, tokens, first start, last end, last finish reason, versions)."""
    tables = record_tables(stage, RECORD_COLUMNS)
    if not tables:
        return {}
    table = pa.concat_tables(tables, promote_options="permissive")
    for name in RECORD_COLUMNS:  # an older shard without a column reads it null
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(len(table), RECORD_SCHEMA.field(name).type))
    table = table.sort_by([("session_id", "ascending"), ("seq", "ascending")])
    grouped = table.group_by("session_id", use_threads=False).aggregate(
        [
            ("seq", "count"),
            ("prompt_tokens", "sum"),
            ("completion_tokens", "sum"),
            ("error", "count"),
            ("started_at", "min"),
            ("finished_at", "max"),
            ("finish_reason", "last"),
            ("task_id", "first"),
            ("provider", "first"),
            ("weight_version", "distinct"),
        ]
    )
    mid_call = span_versions(table)
    rows = {}
    for row in grouped.to_pylist():
        versions = {v for v in row["weight_version_distinct"] if v is not None}
        versions |= mid_call.get(row["session_id"], set())
        rows[row["session_id"]] = {
            "task_id": row["task_id_first"],
            "provider": row["provider_first"],
            "calls": row["seq_count"],
            "prompt_tokens": row["prompt_tokens_sum"] or 0,
            "completion_tokens": row["completion_tokens_sum"] or 0,
            "errors": row["error_count"],
            "started_at": row["started_at_min"].timestamp() if row["started_at_min"] else None,
            "finished_at": row["finished_at_max"].timestamp() if row["finished_at_max"] else None,
            "finish_reason": row["finish_reason_last"],
            "weight_versions": ",".join(sorted(versions, key=version_order)),
        }
    return rows


def span_versions(table: pa.Table) -> dict[str, set[str]]:
    """Per session, the versions of its calls' sampled-token spans (a push may land mid-call: `version_spans`)."""
    spans = table["version_spans"].combine_chunks()
    if spans.null_count == len(spans):
        return {}
    flat = pc.list_flatten(spans)
    pairs = pa.table(
        {
            "session_id": pc.take(table["session_id"], pc.list_parent_indices(spans)),
            "version": pc.struct_field(flat, "version"),
        }
    )
    found: dict[str, set[str]] = {}
    for row in (
        pairs.group_by("session_id", use_threads=False).aggregate([("version", "distinct")]).to_pylist()
    ):
        found[row["session_id"]] = {v for v in row["version_distinct"] if v is not None}
    return found


def version_order(version: str) -> tuple[bool, int, str]:
    """Numbers by value (9 before 10), then labels as text."""
    return (not version.isdigit(), int(version) if version.isdigit() else 0, version)


def outcomes(stage: Stage) -> dict[str, dict[str, Any]]:
    """What the rollout said of each session: the rewards file once written, else the sessions finished so far,
    else (a `loop --service` iteration or a service folder) the service's SessionResults."""
    rewards = stage.root / REWARDS_FILE
    if stage.kind != "service" and rewards.exists():
        try:
            return {r["session_id"]: r for r in read_rewards_table(rewards).to_pylist()}
        except StorageError as exc:  # being written: fall back to the live lines
            log.warning("%s", exc)
    rows = {r["session_id"]: r for r in read_json_lines(stage.root / SESSIONS_FILE) if "session_id" in r}
    results = stage.root / SERVICE_RESULTS_FILE
    lines = read_json_lines(results) if results.exists() else []
    if stage.kind == "service":
        from polar_mitm.dashboard.run_files import service_result_lines

        lines = service_result_lines(stage.root)
    for result in lines:
        rows.setdefault(result.get("session_id", ""), service_outcome(result))
    rows.pop("", None)
    return rows


def service_outcome(result: dict[str, Any]) -> dict[str, Any]:
    """A rollout service's SessionResult as a rewards row (status, reward of its first trace, timings)."""
    traces = (result.get("trajectory") or {}).get("traces") or []
    timing = result.get("timing") or {}
    reward = next((t.get("reward") for t in traces if t.get("reward") is not None), None)
    return {
        "session_id": result.get("session_id"),
        "task_id": result.get("task_id"),
        "reward": reward,
        "status": str(result.get("status") or "").lower() or None,
        "init_seconds": timing.get("init_ms", 0) / 1000 if timing else None,
        "run_seconds": timing.get("run_ms", 0) / 1000 if timing else None,
        "eval_seconds": timing.get("postrun_ms", 0) / 1000 if timing else None,
    }


def judgments(stage: Stage) -> dict[str, Judgment]:
    """What a judge said of the stage's sessions (ROLLOUT/judgments/), by session; none without a judge."""
    folder = stage.root / JUDGMENTS_DIR
    if not folder.is_dir():
        return {}
    try:
        return read_judgments(folder)
    except (OSError, ValueError, TypeError) as exc:  # a file of another version: said, the table still shown
        log.warning("%s: %s", folder, exc)
        return {}


def run_harness(run_dir: Path) -> str | None:
    """The harness the run was started with (`run.json`), e.g. `sdk:openai_chat`."""
    record = read_json(run_dir / RUN_RECORD, {}) or {}
    config = record.get("config", record) if isinstance(record, dict) else {}
    harness = config.get("harness") if isinstance(config, dict) else None
    return str(harness) if harness else None


def stage_table(stage: Stage, harness: str | None) -> pa.Table:
    """The stage's SESSION_SCHEMA rows: every session with records or an outcome."""
    records = per_session_records(stage)
    said = outcomes(stage)
    judged = judgments(stage)
    rows = []
    for session_id in sorted(set(records) | set(said)):
        rec, out, judgment = records.get(session_id, {}), said.get(session_id, {}), judged.get(session_id)
        rows.append(
            {
                "stage": stage.label,
                "kind": stage.kind,
                "iteration": stage.iteration,
                "session_id": session_id,
                "task_id": out.get("task_id") or rec.get("task_id"),
                "harness": harness or rec.get("provider"),
                "status": out.get("status") or "running",
                "finish_reason": rec.get("finish_reason"),
                "end": out.get("end"),  # absent from the rewards of runs before the session-end vocabulary
                "reward": out.get("reward"),
                "outcome": judgment.outcome if judgment else None,
                "judge_score": judgment.score if judgment else None,
                "judge_mode": judgment.mode if judgment else None,
                "calls": rec.get("calls", 0),
                "prompt_tokens": rec.get("prompt_tokens", 0),
                "completion_tokens": rec.get("completion_tokens", 0),
                "errors": rec.get("errors", 0),
                "started_at": rec.get("started_at"),
                "finished_at": rec.get("finished_at"),
                "init_seconds": out.get("init_seconds"),
                "run_seconds": out.get("run_seconds"),
                "eval_seconds": out.get("eval_seconds"),
                "weight_versions": rec.get("weight_versions", ""),
            }
        )
    return pa.Table.from_pylist(rows, schema=SESSION_SCHEMA)


class SessionIndex:
    """Every session of a run as one Arrow table, rebuilt per stage when that stage's files change."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._stages: dict[str, tuple[Any, pa.Table]] = {}
        self._searches: OrderedDict[tuple[Any, str], set[str]] = OrderedDict()
        self._lock = threading.Lock()  # queries run in worker threads

    def table(self) -> pa.Table:
        """The whole table, stages whose files have not changed taken from the last build."""
        with self._lock:
            harness = run_harness(self.run_dir)
            tables = []
            current = stages(self.run_dir)
            for stage in current:
                stamp = watched_stage(stage)
                kept = self._stages.get(stage.label)
                if kept is None or kept[0] != stamp:
                    kept = (stamp, stage_table(stage, harness))
                    self._stages[stage.label] = kept
                tables.append(kept[1])
            for label in set(self._stages) - {s.label for s in current}:
                del self._stages[label]
            return pa.concat_tables(tables) if tables else SESSION_SCHEMA.empty_table()

    def find(self, session_id: str) -> dict[str, Any] | None:
        table = self.table()
        found = table.filter(pc.equal(table["session_id"], session_id))
        return found.slice(0, 1).to_pylist()[0] if len(found) else None

    def matching_text(self, text: str) -> set[str]:
        """Sessions whose prompts or answers (any call's request, conversation or response) contain `text`,
        case-insensitively; the last answers are kept while the records stay as they are."""
        key = (tuple(watched_stage(s) for s in stages(self.run_dir)), text.lower())
        with self._lock:
            if key in self._searches:
                self._searches.move_to_end(key)
                return self._searches[key]
        matched: set[str] = set()
        for stage in stages(self.run_dir):
            for table in record_tables(stage, ("session_id", *TEXT_COLUMNS)):
                hit = pa.array([False] * len(table))
                for name in TEXT_COLUMNS:
                    if name in table.column_names:
                        found = pc.match_substring(table[name], text, ignore_case=True)
                        hit = pc.or_(hit, pc.fill_null(found, False))
                matched.update(table.filter(hit)["session_id"].to_pylist())
        with self._lock:
            self._searches[key] = matched
            while len(self._searches) > SEARCHES_KEPT:
                self._searches.popitem(last=False)
        return matched

    def page(self, query: SessionQuery) -> dict[str, Any]:
        """The rows of one page, the matching total, and each filter's values (for the page's selects)."""
        table = self.table()
        facets = {
            name: sorted(v for v in pc.unique(table[name]).to_pylist() if v is not None) for name in FILTERS
        }
        mask = pa.array([True] * len(table))
        for name, value in query.filters.items():
            if name in FILTERS and value != "":
                mask = pc.and_(mask, pc.fill_null(pc.equal(table[name], value), False))
        if query.text:
            words = pc.or_(
                pc.fill_null(pc.match_substring(table["session_id"], query.text, ignore_case=True), False),
                pc.fill_null(pc.match_substring(table["task_id"], query.text, ignore_case=True), False),
            )
            in_text = pc.is_in(
                table["session_id"], pa.array(sorted(self.matching_text(query.text)), pa.string())
            )
            mask = pc.and_(mask, pc.or_(words, in_text))
        found = table.filter(mask)
        sort = query.sort if query.sort in SORTABLE else "started_at"
        order = "descending" if query.descending else "ascending"
        found = found.sort_by([(sort, order), ("session_id", "ascending")])
        limit = max(1, min(query.limit, MAX_PAGE))
        offset = max(0, query.offset)
        return {
            "total": len(found),
            "sessions": len(table),
            "offset": offset,
            "limit": limit,
            "rows": found.slice(offset, limit).to_pylist(),
            "facets": facets,
        }
