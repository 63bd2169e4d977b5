"""What a run directory holds, for the dashboard: its stages (each iteration's rollout, each evaluation, a rollout
service's records) and the files whose changes a live page must hear of.

Three layouts: a loop run (`storage/run_layout.py`: `iter-K/`, `eval-K/`, `eval-start/`), a `loop --service` run
(the same, with `iter-K/service_results.jsonl` instead of records), and a rollout service's `--out` folder
(`storage/service_layout.py`: `flows/` and `tasks/*/results.jsonl`). A stage is found by its folder, so a stage
that has only begun is listed too.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_mitm.storage import service_layout
from polar_mitm.storage.judgments import JUDGE_SUMMARY_FILE, JUDGMENTS_DIR
from polar_mitm.storage.run_layout import (
    EVENTS_FILE,
    FLOWS_DIR,
    ITERATION_GLOB,
    LOOP_FILE,
    MERGED_DIR,
    REWARDS_FILE,
    SERVICE_RESULTS_FILE,
    SESSIONS_FILE,
    START_EVAL_DIR,
    STATE_FILE,
    iteration_index,
)

_EVALUATION = re.compile(r"eval-(\d+|start)")


@dataclass(frozen=True)
class Stage:
    """One folder of sessions: an iteration's rollout (`iter-K`), an evaluation (`eval-K`, `eval-start`), or a
    rollout service's records (`service`)."""

    label: str
    kind: str  # iteration | evaluation | service
    root: Path
    iteration: int | None  # K; -1 for eval-start; None for a service

    @property
    def flows_dir(self) -> Path:
        return self.root / FLOWS_DIR

    @property
    def merged_dir(self) -> Path:
        return self.root / MERGED_DIR


def is_service_out(run_dir: Path) -> bool:
    """A `serve-rollouts --out` folder: tasks/ beside flows/, no iterations."""
    return (run_dir / service_layout.TASKS_DIR).is_dir()


def stages(run_dir: Path) -> list[Stage]:
    """The run's stages: iterations by K, then evaluations by K (eval-start first), then a service's records."""
    found: list[Stage] = []
    for path in run_dir.glob(ITERATION_GLOB):
        k = iteration_index(path)
        if k is not None and path.is_dir():
            found.append(Stage(path.name, "iteration", path, k))
    for path in run_dir.glob("eval-*"):
        match = _EVALUATION.fullmatch(path.name)
        if match and path.is_dir():
            k = -1 if match.group(1) == "start" else int(match.group(1))
            found.append(Stage(path.name, "evaluation", path, k))
    found.sort(key=lambda s: (s.kind != "iteration", s.iteration if s.iteration is not None else 0))
    if is_service_out(run_dir):
        found.append(Stage("service", "service", run_dir, None))
    return found


def stage_named(run_dir: Path, label: str) -> Stage | None:
    return next((s for s in stages(run_dir) if s.label == label), None)


def read_json(path: Path, default: Any = None) -> Any:
    """A JSON file, or `default` when it is absent or being rewritten (a live run replaces its files)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """A JSONL file's whole lines; a line still being written is left for the next read."""
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_mtime_ns, info.st_size)


def _folder_stamps(folder: Path, depth: int = 3) -> list[tuple[str, tuple[int, int] | None]]:
    """(path, (mtime, size)) of the record files (Parquet shards and live journals) under `folder`, a few levels
    deep (gw-K/ and node-*/ folders hold their own journals)."""
    found = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return found
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and depth > 0:
            found += _folder_stamps(Path(entry.path), depth - 1)
        elif entry.name.endswith((".parquet", ".polarj", ".jsonl")):
            found.append((entry.path, _stamp(Path(entry.path))))
    return found


def watched_stage(stage: Stage) -> tuple[Any, ...]:
    """A fingerprint of one stage's session files (stat only, no reads): outcomes, judgments and records."""
    stamps: list[Any] = [
        _stamp(stage.root / name) for name in (REWARDS_FILE, SESSIONS_FILE, SERVICE_RESULTS_FILE)
    ]
    # A judge's summary is written once the rollout's judging ends.
    stamps.append(_stamp(stage.root / JUDGMENTS_DIR / JUDGE_SUMMARY_FILE))
    stamps += _folder_stamps(stage.flows_dir)
    if stage.kind == "service":
        stamps += _folder_stamps(stage.root / service_layout.TASKS_DIR, 1)
    return tuple(stamps)


def watched(run_dir: Path) -> dict[str, list[Any]]:
    """What a live page may need refetching, each with a fingerprint of its files (stat only):
    `iterations` (loop.json, the stages' state files), `events` (events.jsonl), `sessions` (outcomes, records)."""
    current = stages(run_dir)
    return {
        "iterations": [_stamp(run_dir / LOOP_FILE)] + [_stamp(s.root / STATE_FILE) for s in current],
        "events": [_stamp(run_dir / EVENTS_FILE)],
        "sessions": [watched_stage(s) for s in current],
    }


def service_result_lines(out: Path) -> list[dict[str, Any]]:
    """Every SessionResult a rollout service wrote (`OUT/tasks/*/results.jsonl`), task by task."""
    lines: list[dict[str, Any]] = []
    for results in sorted((out / service_layout.TASKS_DIR).glob(f"*/{service_layout.RESULTS_FILE}")):
        lines += read_json_lines(results)
    return lines


def service_tasks(out: Path) -> list[dict[str, Any]]:
    """A rollout service's tasks: id, state, sessions asked and finished (by status), mean reward."""
    tasks = []
    for folder in sorted((out / service_layout.TASKS_DIR).glob("*")):
        request = read_json(folder / service_layout.REQUEST_FILE, {}) or {}
        state = read_json(folder / service_layout.STATE_FILE, {}) or {}
        results = read_json_lines(folder / service_layout.RESULTS_FILE)
        rewards = [
            t.get("reward")
            for r in results
            for t in ((r.get("trajectory") or {}).get("traces") or [])[:1]
            if t.get("reward") is not None
        ]
        statuses: dict[str, int] = {}
        for result in results:
            status = str(result.get("status"))
            statuses[status] = statuses.get(status, 0) + 1
        tasks.append(
            {
                "task_id": request.get("task_id") or folder.name,
                "status": state.get("status"),
                "sessions_asked": request.get("num_samples") or request.get("n"),
                "sessions_finished": len(results),
                "statuses": statuses,
                "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            }
        )
    return tasks


def start_eval_dir(run_dir: Path) -> Path:
    return run_dir / START_EVAL_DIR
