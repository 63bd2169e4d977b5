"""The report's records section: per stage, what the gateway recorded (calls, sessions, tasks, sampled tokens,
errors), and one row per session of the latest stage with records.

Only the small columns are read (ids, `seq`, finish reason, error, and the sampled ids' count), never prompts, so
the loop can rewrite its page after every iteration at little cost. Unreadable parts are skipped and counted, as
`polar-mitm records` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from polar_mitm.report.collect import RunData, Stage
from polar_mitm.storage.location import StorageError

SESSION_ROWS = 50  # sessions listed; the rest are counted
COLUMNS = ("session_id", "task_id", "seq", "finish_reason", "error")


@dataclass
class SessionRow:
    """One recorded session: its calls in `seq` order, summed up."""

    session_id: str
    task_id: str
    calls: int = 0
    sampled_tokens: int = 0
    errors: int = 0
    finish_reasons: list[str] = field(default_factory=list)  # per call, in seq order
    reward: float | None = None
    end: str | None = None  # how it ended (storage/session_ends.py), from the rewards file


@dataclass
class StageRecords:
    """A stage's records folder, summed up per session."""

    stage: str
    folder: Path
    records: int
    sessions: list[SessionRow]
    problems: list[str]


def read_stage_records(stage: Stage) -> StageRecords | None:
    """The records under `stage.flows_dir` (shards and live journal), per session; None when it has no folder."""
    from polar_mitm.storage.records import list_sources

    if stage.flows_dir is None:
        return None
    found = list_sources([stage.flows_dir])
    problems = list(found.problems)
    rows: list[dict[str, Any]] = []
    for source in found.sources:
        try:
            table = source.read([c for c in (*COLUMNS, "completion_ids") if c in source.columns])
        except StorageError as exc:  # e.g. a corrupt data page behind an intact footer
            problems.append(f"{exc} (skipped)")
            continue
        sampled = pc.fill_null(pc.list_value_length(table["completion_ids"]), 0).to_pylist()
        for row, tokens in zip(table.drop_columns(["completion_ids"]).to_pylist(), sampled, strict=True):
            rows.append({**dict.fromkeys(COLUMNS), **row, "sampled": tokens})
    rewarded = {r["session_id"]: r for r in stage.rewards}
    return StageRecords(stage.label, stage.flows_dir, len(rows), per_session(rows, rewarded), problems)


def per_session(rows: list[dict[str, Any]], rewarded: dict[str, dict[str, Any]]) -> list[SessionRow]:
    """One row per session (its reward and end from its rewards row `rewarded[id]`), sorted by task then session."""
    sessions: dict[str, SessionRow] = {}
    for row in sorted(rows, key=lambda r: (r["session_id"], r["seq"])):
        said = rewarded.get(row["session_id"], {})
        session = sessions.setdefault(
            row["session_id"],
            SessionRow(
                row["session_id"], row["task_id"] or "", reward=said.get("reward"), end=said.get("end")
            ),
        )
        session.calls += 1
        session.sampled_tokens += row["sampled"]
        session.errors += row["error"] is not None
        session.finish_reasons.append(row["finish_reason"])
    return sorted(sessions.values(), key=lambda s: (s.task_id, s.session_id))


def records_context(run: RunData) -> dict[str, Any]:
    """The template's records section: a row per stage with records, and the sessions of the latest one."""
    read = [records for stage in run.stages if (records := read_stage_records(stage)) is not None]
    rows = [
        {
            "stage": r.stage,
            "folder": str(r.folder),
            "records": str(r.records),
            "sessions": str(len(r.sessions)),
            "tasks": str(len({s.task_id for s in r.sessions})),
            "sampled": str(sum(s.sampled_tokens for s in r.sessions)),
            "errors": str(sum(s.errors for s in r.sessions)),
            "problems": "; ".join(r.problems) or "none",
        }
        for r in read
    ]
    if not read:
        return {"rows": rows, "sessions": [], "note": ""}
    latest = read[-1]
    sessions = [session_cells(s) for s in latest.sessions[:SESSION_ROWS]]
    hidden = len(latest.sessions) - len(sessions)
    note = f"sessions of {latest.stage}" + (f" (first {len(sessions)}; {hidden} more)" if hidden else "")
    return {"rows": rows, "sessions": sessions, "note": note}


def session_cells(session: SessionRow) -> dict[str, str]:
    return {
        "session": session.session_id,
        "task": session.task_id or "—",
        "calls": str(session.calls),
        "sampled": str(session.sampled_tokens),
        "finish": finish_runs(session.finish_reasons),
        "errors": str(session.errors),
        "end": session.end or "—",
        "reward": "—" if session.reward is None else f"{session.reward:.2f}",
    }


def finish_runs(reasons: list[str]) -> str:
    """The calls' finish reasons in order, repeats folded: `tool_calls ×2 → stop`."""
    runs: list[list[Any]] = []
    for reason in reasons:
        if runs and runs[-1][0] == reason:
            runs[-1][1] += 1
        else:
            runs.append([reason, 1])
    return " → ".join(f"{reason} ×{n}" if n > 1 else str(reason) for reason, n in runs)
