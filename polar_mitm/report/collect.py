"""Read what a run directory holds into one `RunData`: the loop's iterations, or a single rollout/merge/train stage.

Layouts understood (anything missing is simply absent from the report):

- a loop run (`polar-mitm loop`, the demo): `loop.json` and `iter-K/{rewards.parquet, merged/, train/, flows/}`,
  and `events.jsonl` (start, resume, iteration_done, eval_done, finished) for the run's history and resume points;
- a single stage directory: `metrics.jsonl` (a `grpo` output dir), `_summary.json` + shards (a `merge` output dir),
  `rewards.parquet` (a rollout), record shards or the gateway's `_engine.json` (a records folder), or any of those
  in `merged/`, `train/`, `flows/` subfolders.

Several folders of one hand-run pipeline (records, merge, grpo) make one report: `report/inputs.py`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.storage.engine_info import ENGINE_FILE, read_engine_file
from polar_mitm.storage.location import InputNotFound
from polar_mitm.storage.rewards import read_rewards_table
from polar_mitm.storage.run_layout import (
    EVENTS_FILE,
    FLOWS_DIR,
    ITERATION_GLOB,
    LOOP_FILE,
    REWARDS_FILE,
    iteration_index,
)
from polar_mitm.tasks.task_file import passed

logger = logging.getLogger(__name__)


@dataclass
class Stage:
    """One iteration's artifacts (or the whole directory, for a single-stage run)."""

    label: str
    root: Path
    stats: dict[str, Any] | None = None  # the loop's IterationStats row
    metrics: list[dict[str, Any]] = field(default_factory=list)  # train metrics.jsonl rows
    merge_summary: dict[str, Any] | None = None
    rewards: list[dict[str, Any]] = field(default_factory=list)  # session_id, task_id, reward, status
    merged_dir: Path | None = None
    train_dir: Path | None = None
    flows_dir: Path | None = None


@dataclass(frozen=True)
class ReportInput:
    """One folder given to a combined report, and what it was found to hold."""

    path: Path
    kinds: tuple[str, ...]  # records | rollout | merged | grpo (report/inputs.py)


@dataclass
class RunData:
    """Everything the report shows, read from one directory (or, combined, from several: `inputs`)."""

    root: Path  # the first input for a combined report
    kind: str  # loop | stage | combined
    stages: list[Stage]
    events: list[dict[str, Any]] = field(default_factory=list)  # the loop's events.jsonl rows, in order
    inputs: list[ReportInput] = field(default_factory=list)  # a combined report's folders, as given

    @property
    def has_iterations(self) -> bool:
        return any(s.stats is not None for s in self.stages)


def collect_run(root: str | Path) -> RunData:
    """Read `root` (see the module docstring); raises FileNotFoundError when it holds nothing a report can show."""
    root = Path(root)
    if not root.is_dir():
        raise InputNotFound(f"{root} is not a directory")
    iteration_dirs = sorted(
        (p for p in root.glob(ITERATION_GLOB) if p.is_dir() and iteration_index(p) is not None),
        key=iteration_index,
    )
    if iteration_dirs:
        stats = _loop_stats(root)
        stages = [
            read_stage(d, f"iteration {iteration_index(d)}", stats.get(iteration_index(d)))
            for d in iteration_dirs
        ]
        run = RunData(root=root, kind="loop", stages=stages, events=read_events(root / EVENTS_FILE))
    else:
        run = RunData(root=root, kind="stage", stages=[read_stage(root, root.name)])
    if not any(
        s.metrics or s.merge_summary or s.rewards or s.merged_dir or s.stats or s.flows_dir
        for s in run.stages
    ):
        raise InputNotFound(f"{root}: no loop.json, metrics.jsonl, merge summary, rewards or records found")
    return run


def read_events(path: Path) -> list[dict[str, Any]]:
    """The loop's events, oldest first; a last line cut short by a kill mid-append is left out."""
    if not path.exists():
        return []
    events = []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines):  # only the line being written when the loop was killed may be partial
                logger.warning("%s:%d: not a JSON event, left out of the report", path, number)
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def resume_points(run: RunData) -> list[dict[str, Any]]:
    """The loop's `resume` events: where (iteration, stage) and when a killed run was taken up again."""
    return [event for event in run.events if event["event"] == "resume"]


def _loop_stats(root: Path) -> dict[int, dict[str, Any]]:
    """The loop's per-iteration table by iteration number (empty while a loop is still running)."""
    path = root / LOOP_FILE
    if not path.exists():
        return {}
    return {int(row["iteration"]): row for row in json.loads(path.read_text())}


def read_stage(root: Path, label: str, stats: dict[str, Any] | None = None) -> Stage:
    """The artifacts found in `root` itself or in its `merged/`, `train/`, `flows/` subfolders."""
    stage = Stage(label=label, root=root, stats=stats)
    stage.train_dir = _first_dir(root, "train", marker="metrics.jsonl")
    if stage.train_dir is not None:
        stage.metrics = read_metrics_file(stage.train_dir / "metrics.jsonl")
    stage.merged_dir = _first_dir(root, "merged", marker="_summary.json")
    if stage.merged_dir is not None:
        stage.merge_summary = json.loads((stage.merged_dir / "_summary.json").read_text())
    rewards = root / REWARDS_FILE
    if rewards.exists():
        stage.rewards = read_rewards_table(
            rewards, ["session_id", "task_id", "reward", "status", "end"]
        ).to_pylist()
    elif stage.merged_dir is not None:  # a merge directory alone: the rewards joined into its sequences
        stage.rewards = merged_session_rewards(stage.merged_dir)
    flows = root / FLOWS_DIR
    stage.flows_dir = flows if flows.is_dir() else (root if holds_records(root) else None)
    return stage


def holds_records(folder: Path) -> bool:
    """Is `folder` a records folder: the gateway's `_engine.json`, or record shards or a live journal under it."""
    from polar_mitm.storage.records import list_sources

    return (folder / ENGINE_FILE).exists() or bool(list_sources([folder]).sources)


def merged_session_rewards(merged_dir: Path) -> list[dict[str, Any]]:
    """One row per session of the merged shards (session_id, task_id, reward), for sessions with a reward."""
    from polar_mitm.storage.merged import read_merged

    try:
        table = read_merged(merged_dir, columns=["session_id", "task_id", "reward"])
    except FileNotFoundError:  # a merge that wrote no shard: no sequences, so no rewards
        return []
    sessions: dict[str, dict[str, Any]] = {}
    for row in table.to_pylist():
        if row["reward"] is not None:
            sessions.setdefault(row["session_id"], {**row, "status": None})
    return list(sessions.values())


def _first_dir(root: Path, sub: str, *, marker: str) -> Path | None:
    """`root` when it holds `marker`, else `root/sub` when that does."""
    for candidate in (root, root / sub):
        if (candidate / marker).exists():
            return candidate
    return None


def read_metrics_file(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows that are per-step logs (the closing `train_runtime` summary row is left out)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "train_runtime" not in r]


def pass_rates(stage: Stage) -> dict[str, tuple[int, int, float]]:
    """Per task: (sessions passed, sessions, mean reward); a session passes as in the loop (`tasks.passed`)."""
    by_task: dict[str, list[float]] = {}
    for row in stage.rewards:
        if row["reward"] is not None:
            by_task.setdefault(row["task_id"] or "(no task)", []).append(float(row["reward"]))
    return {
        task: (sum(passed(r) for r in rs), len(rs), sum(rs) / len(rs)) for task, rs in sorted(by_task.items())
    }


def reward_summary(stage: Stage) -> tuple[float, float] | None:
    """(mean, std) of the stage's session rewards: the loop's numbers when it wrote them, else from rewards."""
    if stage.stats is not None:
        return float(stage.stats["reward_mean"]), float(stage.stats["reward_std"])
    rewards = [float(r["reward"]) for r in stage.rewards if r["reward"] is not None]
    if not rewards:
        return None
    mean = sum(rewards) / len(rewards)
    return mean, (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5


def engine_info(run: RunData) -> dict[str, Any] | None:
    """The engine description the gateway recorded next to the records (model, tokenizer path, end-of-turn id)."""
    for stage in run.stages:
        info = read_engine_file(str(stage.flows_dir)) if stage.flows_dir is not None else None
        if info is not None:
            return info
    return None
