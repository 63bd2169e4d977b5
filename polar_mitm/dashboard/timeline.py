"""The Engines page: each engine's calls on a time axis (start, first token where the engine timed it, end) and
every weight push the run's files tell of.

A push is found three ways, each marked with its source:

- `iteration end`: the loop's push stage (`iter-K/state.json`, its time and the version pushed);
- `training step`: a push during the training (`--push-every-steps N`: the trainer pushes after every N-th
  optimizer step, `train/sync.py`); its time is that step's line in `iter-K/train/metrics.jsonl`, written just
  after the push, and its version the training's base version advanced by the step;
- `in flight`: a call whose sampled tokens span two weight versions (the records' `version_spans`): the engine
  swapped weights between two of its tokens, at a time estimated by the token's place between the call's start
  and end (the records keep no per-token time).

First token: a record keeps no time of its first token. An engine that reports its queue and prefill seconds in its
answer's meta info (the embedded engine does, `engine/generation.py`) gives it for calls answered whole: start +
queue + prefill. A streamed call's record holds no engine timing (the gateway assembles the stream), so it has no
first-token tick.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from polar_mitm.dashboard.run_files import Stage, read_json, read_json_lines, stages
from polar_mitm.dashboard.sessions import record_tables
from polar_mitm.storage.engine_info import ENGINE_FILE, read_engine_file
from polar_mitm.storage.records import RECORD_SCHEMA, version_spans_of
from polar_mitm.storage.run_layout import RUN_RECORD, STATE_FILE, TRAIN_DIR
from polar_mitm.train.stats import advanced_version

TIMELINE_CALLS = 5000  # the latest calls drawn per engine
FIRST_TOKEN_PHASES = ("queue_time", "prefill_latency")  # seconds before the first token, in the engine's meta
TIMELINE_COLUMNS = (
    "session_id",
    "seq",
    "started_at",
    "finished_at",
    "weight_version",
    "engine_meta_json",
    "version_spans",
    "completion_tokens",
)


def first_token(meta_json: str | None, started: float) -> float | None:
    """The first token's time: the call's start plus the engine's queue and prefill seconds, when its meta info
    reports both; None otherwise (streamed calls, engines that do not time their phases)."""
    if not meta_json:
        return None
    try:
        meta = json.loads(meta_json)
    except ValueError:
        return None
    phases = [meta.get(key) for key in FIRST_TOKEN_PHASES] if isinstance(meta, dict) else []
    if not phases or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in phases):
        return None
    return started + sum(phases)


def engine_name(stage: Stage) -> tuple[str, dict[str, Any]]:
    """The engine a stage's gateways spoke to: its backend URL (and kind) from the records' `_engine.json`."""
    for engine_file in sorted(stage.flows_dir.rglob(ENGINE_FILE)) if stage.flows_dir.is_dir() else []:
        info = read_engine_file(str(engine_file.parent)) or {}
        if info.get("backend"):
            return str(info["backend"]), {
                "kind": info.get("engine_kind"),
                "model": info.get("served_model_name"),
            }
    return "engine", {}


def in_flight_pushes(row: dict[str, Any], stage: str, start: float, end: float) -> list[dict[str, Any]]:
    """The version changes inside one call: a mark per span after the first, at its token's share of the call."""
    spans = version_spans_of(row.get("version_spans"), row.get("weight_version"))
    tokens = max(row.get("completion_tokens") or 0, spans[-1][0] + 1)
    marks = []
    for (_, before), (token, version) in zip(spans, spans[1:], strict=False):
        if version != before:
            marks.append(
                {
                    "time": start + (end - start) * token / tokens,
                    "weight_version": version,
                    "stage": stage,
                    "source": "in flight",
                    "detail": f"{row['session_id']} #{row['seq']}: v{before} → v{version} at token {token}",
                }
            )
    return marks


def training_step_pushes(run_dir: Path, stage: Stage, state: dict[str, Any]) -> list[dict[str, Any]]:
    """The pushes `--push-every-steps N` made during a stage's training: one per N-th step's metrics line."""
    config = (read_json(run_dir / RUN_RECORD, {}) or {}).get("config") or {}
    every = ((config.get("grpo") or {}).get("push_every_steps")) or 0
    if not every:
        return []
    base = ((state.get("stages") or {}).get("train") or {}).get("base_weight_version")
    marks = []
    for line in read_json_lines(stage.root / TRAIN_DIR / "metrics.jsonl"):
        step = line.get("step")
        if "train_runtime" in line or not isinstance(step, int) or step % every or "time" not in line:
            continue  # the closing summary repeats the last step
        marks.append(
            {
                "time": line["time"],
                "weight_version": advanced_version(base, step) if base is not None else None,
                "stage": stage.label,
                "source": "training step",
                "detail": f"after optimizer step {step} (--push-every-steps {every})",
            }
        )
    return marks


def stage_pushes(run_dir: Path, stage: Stage) -> list[dict[str, Any]]:
    """A stage's pushes from its files: the loop's push stage and the training's own."""
    state = read_json(stage.root / STATE_FILE, {}) or {}
    marks = training_step_pushes(run_dir, stage, state)
    push = (state.get("stages") or {}).get("push")
    if push and push.get("time"):
        marks.append(
            {
                "time": push["time"],
                "weight_version": push.get("weight_version"),
                "stage": stage.label,
                "source": "iteration end",
                "detail": "the loop's push stage",
            }
        )
    return marks


def stage_calls(stage: Stage) -> pa.Table | None:
    """The stage's records' timing columns (a column an older shard lacks reads null), with their stage."""
    tables = record_tables(stage, TIMELINE_COLUMNS)
    if not tables:
        return None
    table = pa.concat_tables(tables, promote_options="permissive")
    for name in TIMELINE_COLUMNS:
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(len(table), RECORD_SCHEMA.field(name).type))
    table = table.select(list(TIMELINE_COLUMNS))
    return table.append_column("stage", pa.array([stage.label] * len(table), pa.string()))


def timeline_call(row: dict[str, Any]) -> dict[str, Any]:
    """One call as the timeline draws it: epoch seconds of its start, first token (or None) and end."""
    start = row["started_at"].timestamp()
    return {
        "stage": row["stage"],
        "session_id": row["session_id"],
        "seq": row["seq"],
        "start": start,
        "first_token": first_token(row.get("engine_meta_json"), start),
        "end": row["finished_at"].timestamp(),
        "weight_version": row.get("weight_version"),
    }


def engines(run_dir: Path) -> dict[str, Any]:
    """Per engine, its latest calls (start, first token when known, end), and every weight push found (time,
    version, source); times are epoch seconds. Only the calls drawn and those a push landed in leave Arrow."""
    lanes: dict[str, dict[str, Any]] = {}
    pushes: list[dict[str, Any]] = []
    crossings: list[dict[str, Any]] = []
    for stage in stages(run_dir):
        pushes += stage_pushes(run_dir, stage)
        table = stage_calls(stage)
        if table is None:
            continue
        several = pc.fill_null(pc.greater(pc.list_value_length(table["version_spans"]), 1), False)
        for row in table.filter(several).to_pylist():
            start, end = row["started_at"].timestamp(), row["finished_at"].timestamp()
            crossings += in_flight_pushes(row, stage.label, start, end)
        name, info = engine_name(stage)
        lanes.setdefault(name, {"engine": name, **info, "tables": []})["tables"].append(table)
    for lane in lanes.values():
        table = pa.concat_tables(lane.pop("tables"), promote_options="permissive").sort_by("started_at")
        lane["total_calls"] = len(table)
        lane["calls"] = [
            timeline_call(row) for row in table.slice(max(0, len(table) - TIMELINE_CALLS)).to_pylist()
        ]
    pushes += one_mark_per_version(crossings)
    return {"engines": list(lanes.values()), "pushes": sorted(pushes, key=lambda p: p["time"])}


def one_mark_per_version(crossings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The in-flight marks of one push (every call it landed in: same stage, same version) as one mark, at the
    median of their estimates."""
    by_push: dict[tuple[str, str | None], list[dict[str, Any]]] = {}
    for mark in crossings:
        by_push.setdefault((mark["stage"], mark["weight_version"]), []).append(mark)
    marks = []
    for group in by_push.values():
        group.sort(key=lambda m: m["time"])
        middle = group[len(group) // 2]
        calls = f"{len(group)} calls sampled across it" if len(group) > 1 else "1 call sampled across it"
        marks.append({**middle, "detail": f"{calls}; e.g. {middle['detail']}"})
    return marks
