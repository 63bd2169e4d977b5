"""The dashboard's run-level pages, read from the files the loop writes: Overview (loop.json's `IterationStats`
rows, training metrics, the stage in progress), Discarded (what did not train, and why), Engines (each engine's
calls on a time axis, with the weight pushes), Evaluation (held-out pass@k per evaluation and per task) and a
rollout service's tasks.

Everything here is a pure read of small files plus the record columns of times; nothing is kept between calls
except by the session index (`sessions.py`), whose table Discarded reuses.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from polar_mitm.dashboard.run_files import (
    Stage,
    is_service_out,
    read_json,
    read_json_lines,
    service_tasks,
    stages,
)
from polar_mitm.dashboard.sessions import SessionIndex, record_tables, run_harness
from polar_mitm.storage.engine_info import ENGINE_FILE, read_engine_file
from polar_mitm.storage.run_layout import (
    EVENTS_FILE,
    LOOP_FILE,
    RUN_RECORD,
    SKIPPED_TRAINING_FILE,
    STATE_FILE,
    TRAIN_DIR,
)

log = logging.getLogger(__name__)

TRAINED_STATUSES = ("ok", "failed", "passed", "completed")  # evaluated sessions: their reward trains
TIMELINE_CALLS = 5000  # the latest calls drawn per engine
FIRST_TOKEN_KEYS = ("first_token_at", "first_token_time", "ttft_s", "ttft")


def training_metrics(stage_root: Path) -> dict[str, float | None]:
    """The last training step's KL and clip ratio (`train/metrics.jsonl`), when it trained."""
    rows = read_json_lines(stage_root / TRAIN_DIR / "metrics.jsonl")
    if not rows:
        return {"kl": None, "clip_ratio": None, "steps": 0}
    last = rows[-1]
    kl = next((v for k, v in last.items() if k == "kl" or k.endswith("/kl") or k.startswith("kl")), None)
    return {"kl": kl, "clip_ratio": last.get("clip_ratio/region_mean"), "steps": len(rows)}


def mean_staleness(call_staleness: dict[str, int]) -> float | None:
    """Weight updates behind, averaged over the trained calls (loop.json's `call_staleness` histogram)."""
    calls = sum(call_staleness.values())
    return sum(int(k) * n for k, n in call_staleness.items()) / calls if calls else None


def overview(run_dir: Path) -> dict[str, Any]:
    """The run's settings, one row per finished iteration, and the iteration in progress (its state.json)."""
    record = read_json(run_dir / RUN_RECORD, {}) or {}
    config = record.get("config") or {}
    iterations = []
    for row in read_json(run_dir / LOOP_FILE, []) or []:
        root = run_dir / f"iter-{row.get('iteration')}"
        evaluation = row.get("eval") or {}
        iterations.append(
            {
                **{k: v for k, v in row.items() if k != "eval"},
                "pass_at": evaluation.get("pass_at") or {},
                "staleness": mean_staleness(row.get("call_staleness") or {}),
                **training_metrics(root),
            }
        )
    running = []
    for stage in stages(run_dir):
        state = read_json(stage.root / STATE_FILE, {}) or {}
        if state.get("running"):
            running.append({"stage": stage.label, "running": state["running"]})
    return {
        "run_dir": str(run_dir),
        "service": is_service_out(run_dir),
        "settings": {
            "tasks": config.get("tasks"),
            "model": config.get("model"),
            "harness": run_harness(run_dir),
            "iterations": config.get("iterations"),
            "group_size": config.get("group_size"),
            "started": record.get("started"),
        },
        "iterations": iterations,
        "running": running,
        "finished": any(e.get("event") == "finished" for e in read_json_lines(run_dir / EVENTS_FILE)),
        "stages": [{"label": s.label, "kind": s.kind, "iteration": s.iteration} for s in stages(run_dir)],
    }


def events(run_dir: Path) -> list[dict[str, Any]]:
    return read_json_lines(run_dir / EVENTS_FILE)


def _discard(session: dict[str, Any], reason: str, detail: str = "") -> dict[str, Any]:
    keys = ("stage", "iteration", "session_id", "task_id", "status", "reward", "calls", "finish_reason")
    return {**{k: session.get(k) for k in keys}, "reason": reason, "detail": detail}


def merged_sessions(stage: Stage) -> set[str] | None:
    """The sessions with a merged sequence; None when the stage has no merged data (yet)."""
    if not stage.merged_dir.is_dir():
        return None
    from polar_mitm.storage.merged import MergedShards

    try:
        return set(MergedShards.at(stage.merged_dir).table(columns=["session_id"])["session_id"].to_pylist())
    except Exception as exc:  # noqa: BLE001 — a shard being written: said, and the rest shown
        log.warning("%s: %s", stage.merged_dir, exc)
        return None


def discarded(run_dir: Path, index: SessionIndex) -> dict[str, Any]:
    """Every session or group that did not train, with its reason, and each merge's own exclusion counts."""
    record = read_json(run_dir / RUN_RECORD, {}) or {}
    keep_flat = bool(((record.get("config") or {}).get("grpo") or {}).get("keep_zero_advantage_groups"))
    table = index.table().to_pylist()
    by_stage: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in table:
        by_stage[row["stage"]].append(row)
    rows: list[dict[str, Any]] = []
    merges: list[dict[str, Any]] = []
    for stage in stages(run_dir):
        sessions = by_stage.get(stage.label, [])
        if stage.kind == "evaluation":
            rows += [_discard(s, "held-out", "evaluation: measured, never trained on") for s in sessions]
            continue
        rows += stage_discards(stage, sessions, keep_flat)
        summary = read_json(stage.merged_dir / "_summary.json")
        if summary:
            merges.append(
                {
                    "stage": stage.label,
                    "excluded": summary.get("excluded") or {},
                    "breaks": summary.get("breaks") or {},
                    "dropped_unrewarded_sequences": summary.get("dropped_unrewarded_sequences", 0),
                    "problems": summary.get("problems") or [],
                }
            )
    return {"rows": rows, "merges": merges}


def stage_discards(stage: Stage, sessions: list[dict[str, Any]], keep_flat: bool) -> list[dict[str, Any]]:
    """An iteration's sessions that did not train: bad status, no reward, flat group, not merged, training skipped."""
    rows, listed = [], set()
    for s in sessions:
        if s["status"] == "running":
            continue
        if s["status"] not in TRAINED_STATUSES:
            rows.append(_discard(s, s["status"], "the session did not finish to be evaluated"))
        elif s["reward"] is None:
            rows.append(_discard(s, "no reward", "no evaluation result"))
        else:
            continue
        listed.add(s["session_id"])
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in sessions:
        if s["session_id"] not in listed and s["reward"] is not None:
            groups[s["task_id"] or ""].append(s)
    for task, members in groups.items():
        if len(members) > 1 and len({m["reward"] for m in members}) == 1 and not keep_flat:
            detail = f"every session of task {task} got {members[0]['reward']}: zero advantage"
            rows += [_discard(m, "flat group", detail) for m in members]
            listed.update(m["session_id"] for m in members)
    merged = merged_sessions(stage)
    if merged is not None:
        for s in sessions:
            if s["session_id"] not in listed and s["status"] != "running" and s["session_id"] not in merged:
                rows.append(_discard(s, "not merged", "no trainable sequence (see the merge's exclusions)"))
                listed.add(s["session_id"])
    skipped = read_json(stage.root / TRAIN_DIR / SKIPPED_TRAINING_FILE)
    if skipped:
        for s in sessions:
            if s["session_id"] not in listed and s["status"] != "running":
                rows.append(_discard(s, "training skipped", "every group flat: no optimizer step"))
    return rows


def first_token(meta_json: str | None, started: float) -> float | None:
    """The first token's time, from the engine's timings when it gave them (seconds after start or epoch)."""
    if not meta_json:
        return None
    try:
        meta = json.loads(meta_json)
    except ValueError:
        return None
    for key in FIRST_TOKEN_KEYS:
        value = meta.get(key) if isinstance(meta, dict) else None
        if isinstance(value, int | float):
            return float(value) if value > 1e9 else started + float(value)
    return None


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


def engines(run_dir: Path) -> dict[str, Any]:
    """Per engine, its calls (start, first token when known, end), and the weight pushes (state.json's push stage,
    with the version pushed); times are epoch seconds."""
    lanes: dict[str, dict[str, Any]] = {}
    pushes = []
    columns = ("session_id", "seq", "started_at", "finished_at", "weight_version", "engine_meta_json")
    for stage in stages(run_dir):
        state = read_json(stage.root / STATE_FILE, {}) or {}
        push = (state.get("stages") or {}).get("push")
        if push and push.get("time"):
            pushes.append(
                {"time": push["time"], "weight_version": push.get("weight_version"), "stage": stage.label}
            )
        tables = record_tables(stage, columns)
        if not tables:
            continue
        name, info = engine_name(stage)
        lane = lanes.setdefault(name, {"engine": name, **info, "calls": []})
        table = pa.concat_tables(tables, promote_options="permissive")
        for row in table.to_pylist():
            if row.get("started_at") is None or row.get("finished_at") is None:
                continue
            start = row["started_at"].timestamp()
            lane["calls"].append(
                {
                    "stage": stage.label,
                    "session_id": row["session_id"],
                    "seq": row["seq"],
                    "start": start,
                    "first_token": first_token(row.get("engine_meta_json"), start),
                    "end": row["finished_at"].timestamp(),
                    "weight_version": row.get("weight_version"),
                }
            )
    for lane in lanes.values():
        lane["calls"].sort(key=lambda c: c["start"])
        lane["total_calls"] = len(lane["calls"])
        lane["calls"] = lane["calls"][-TIMELINE_CALLS:]
    return {"engines": list(lanes.values()), "pushes": sorted(pushes, key=lambda p: p["time"])}


def evaluations(run_dir: Path) -> dict[str, Any]:
    """Each held-out evaluation (eval-start, eval-K): the weights, pass@k over tasks, and each task's pass@k."""
    from polar_mitm.loop.evaluation import pass_at_k, reported_ks

    found = []
    for stage in stages(run_dir):
        if stage.kind != "evaluation":
            continue
        result = read_json(stage.root / "eval.json")
        if not result:
            found.append({"stage": stage.label, "iteration": stage.iteration, "running": True, "tasks": []})
            continue
        tasks = []
        for task_id, counts in sorted((result.get("per_task") or {}).items()):
            n, c = int(counts.get("samples", 0)), int(counts.get("passed", 0))
            ks = reported_ks(n) if n else []
            tasks.append(
                {
                    "task_id": task_id,
                    "samples": n,
                    "passed": c,
                    "pass_at": {f"pass@{k}": pass_at_k(n, c, k) for k in ks},
                }
            )
        found.append(
            {
                "stage": stage.label,
                "iteration": result.get("iteration", stage.iteration),
                "weight_version": result.get("weight_version"),
                "sessions": result.get("sessions"),
                "reward_mean": result.get("reward_mean"),
                "pass_at": result.get("pass_at") or {},
                "greedy": result.get("greedy"),
                "seconds": result.get("seconds"),
                "tasks": tasks,
            }
        )
    return {"evaluations": found}


def service(run_dir: Path) -> dict[str, Any]:
    """A rollout service's tasks (its --out folder) or, for `loop --service`, each iteration's service results."""
    if is_service_out(run_dir):
        return {"tasks": service_tasks(run_dir)}
    tasks: dict[tuple[str, str], dict[str, Any]] = {}
    for stage in stages(run_dir):
        for result in read_json_lines(stage.root / "service_results.jsonl"):
            task = tasks.setdefault(
                (stage.label, str(result.get("task_id"))),
                {
                    "stage": stage.label,
                    "task_id": result.get("task_id"),
                    "sessions_finished": 0,
                    "statuses": {},
                },
            )
            task["sessions_finished"] += 1
            status = str(result.get("status"))
            task["statuses"][status] = task["statuses"].get(status, 0) + 1
    return {"tasks": list(tasks.values())}
