"""The dashboard's run-level pages, read from the files the loop writes: Overview (loop.json's `IterationStats`
rows, training metrics, the stage in progress), Discarded (what did not train, and why: a session's status or
`end`, a flat group, the merge's exclusions, the tokens `--max-staleness` masked), Evaluation (held-out pass@k per
evaluation and per task) and a rollout service's tasks. The Engines page is `timeline.py`.

Everything here is a pure read of small files; nothing is kept between calls except by the session index
(`sessions.py`), whose table Discarded reuses.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from polar_mitm.dashboard.run_files import (
    Stage,
    is_service_out,
    read_json,
    read_json_lines,
    service_tasks,
    stages,
)
from polar_mitm.dashboard.sessions import SessionIndex, run_harness
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
DISCARD_KEYS = (
    "stage",
    "iteration",
    "session_id",
    "task_id",
    "status",
    "end",
    "reward",
    "calls",
    "finish_reason",
)
MASKED_KEY = "staleness/masked_tokens"  # train/staleness.py: sampled tokens over --max-staleness, per step


def training_lines(stage_root: Path) -> list[dict[str, Any]]:
    """A training's per-step metrics lines (`train/metrics.jsonl`), without its closing summary."""
    return [r for r in read_json_lines(stage_root / TRAIN_DIR / "metrics.jsonl") if "train_runtime" not in r]


def training_metrics(stage_root: Path) -> dict[str, float | None]:
    """The last training step's KL and clip ratio, and the tokens `--max-staleness` masked over its steps."""
    rows = training_lines(stage_root)
    if not rows:
        return {"kl": None, "clip_ratio": None, "steps": 0, "masked_tokens": None}
    last = rows[-1]
    kl = next((v for k, v in last.items() if k == "kl" or k.endswith("/kl") or k.startswith("kl")), None)
    return {
        "kl": kl,
        "clip_ratio": last.get("clip_ratio/region_mean"),
        "steps": len(rows),
        "masked_tokens": masked_tokens(rows),
    }


def masked_tokens(rows: list[dict[str, Any]]) -> float | None:
    """Sampled tokens masked for staleness, summed over the steps (None: no step counted them, i.e. no limit)."""
    counts = [r[MASKED_KEY] for r in rows if isinstance(r.get(MASKED_KEY), int | float)]
    return sum(counts) if counts else None


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
    """A Discarded row; a session that ended otherwise than completed is discarded for that end (`end`, when the
    run's rewards hold it), the check's word kept in the detail."""
    end = session.get("end")
    if end and end != "completed" and reason not in ("flat group", "held-out", "training skipped"):
        detail, reason = f"{reason}: {detail}" if detail else reason, end
    return {**{k: session.get(k) for k in DISCARD_KEYS}, "reason": reason, "detail": detail}


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
    """Every session or group that did not train, with its reason; each merge's own exclusion counts; how the
    sessions of each stage ended (`end`, where the rewards hold it); and the tokens `--max-staleness` masked."""
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
    ends = [
        {"stage": label, "ends": dict(Counter(s["end"] for s in sessions if s.get("end")))}
        for label, sessions in by_stage.items()
        if any(s.get("end") for s in sessions)
    ]
    return {"rows": rows, "merges": merges, "ends": ends, "staleness": staleness_masks(run_dir)}


def staleness_masks(run_dir: Path) -> dict[str, Any]:
    """Per trained iteration, the sampled tokens `--max-staleness K` left out of the loss (`staleness/masked_tokens`
    of each step's metrics line, summed: a row trained in two epochs counts twice) and the call staleness the loop
    counted (loop.json's `call_staleness`: calls by weight updates behind)."""
    config = (read_json(run_dir / RUN_RECORD, {}) or {}).get("config") or {}
    limit = (config.get("grpo") or {}).get("max_staleness")
    by_iteration = {r.get("iteration"): r for r in read_json(run_dir / LOOP_FILE, []) or []}
    found = []
    for stage in stages(run_dir):
        if stage.kind != "iteration":
            continue
        lines = training_lines(stage.root)
        if not lines:
            continue
        masking = [r for r in lines if (r.get(MASKED_KEY) or 0) > 0]
        trained = sum(r.get("batch/loss_tokens") or 0 for r in lines)  # the loss mask's, after masking
        found.append(
            {
                "stage": stage.label,
                "iteration": stage.iteration,
                "steps": len(lines),
                "steps_masking": len(masking),
                "masked_tokens": masked_tokens(lines),
                "trained_tokens": trained or None,
                "staleness_max": max((r.get("staleness/max") or 0 for r in lines), default=None),
                "call_staleness": (by_iteration.get(stage.iteration) or {}).get("call_staleness") or {},
            }
        )
    return {"max_staleness": limit, "iterations": found}


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
