"""Experiment trackers for `polar-mitm loop --report-to`: the loop's per-iteration figures, its held-out
evaluations and the trainer's per-step metrics go to one tracked run for the whole loop, so a long run shows up
where a team already watches runs.

Each iteration's training keeps `report_to=[]` (transformers would open a new tracked run per training, with its
step count restarting); the loop instead forwards that training's `metrics.jsonl` rows (written by the in-process
trainer and by `--train-processes` launches alike) at their run-wide optimizer step `run_step`.
TensorBoard event files are written with torch's `SummaryWriter` (needs the `tensorboard` package, a project
dependency). MLflow and W&B are not installed in this environment, so they are refused at start in one line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Protocol

TrackerName = Literal["tensorboard", "mlflow", "wandb", "none"]
TRACKERS: tuple[str, ...] = ("tensorboard", "mlflow", "wandb", "none")
TENSORBOARD_DIR = "tensorboard"  # under the run directory
# metrics.jsonl keys that are bookkeeping, not metrics
NOT_METRICS = frozenset({"step", "run_step", "epoch", "time"})


class TrackerUnavailable(RuntimeError):
    """The chosen tracker cannot be used here (its package is missing)."""


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NoTracker:
    """`--report-to none`: loop.json and metrics.jsonl only."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """One TensorBoard run (event files under `log_dir`) for the whole loop."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # a long run's curves show up as they are made

    def close(self) -> None:
        self.writer.close()


def check_tracker(name: str) -> None:
    """Refuse, before anything starts, a tracker that is unknown or not installed."""
    if name not in TRACKERS:
        raise TrackerUnavailable(f"--report-to {name}: not one of {' | '.join(TRACKERS)}")
    if name in ("mlflow", "wandb"):
        raise TrackerUnavailable(
            f"--report-to {name}: not supported in this build ({name} is not installed here); "
            f"use --report-to tensorboard (event files under RUN/{TENSORBOARD_DIR})"
        )


def open_tracker(name: str, run_dir: Path) -> Tracker:
    """The tracker of `--report-to NAME` for a run in `run_dir`."""
    check_tracker(name)
    if name == "tensorboard":
        return TensorBoardTracker(run_dir / TENSORBOARD_DIR)
    return NoTracker()


def numeric_metrics(row: dict[str, Any], prefix: str) -> dict[str, float]:
    """The finite numbers of a metrics row, tagged `prefix/key` (nested dicts flattened as `prefix/key/sub`)."""
    metrics: dict[str, float] = {}
    for key, value in row.items():
        if key in NOT_METRICS:
            continue
        if isinstance(value, dict):
            metrics.update(numeric_metrics(value, f"{prefix}/{key}"))
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            metrics[f"{prefix}/{key}"] = float(value)
    return metrics


def log_training_metrics(tracker: Tracker, metrics_file: Path) -> int:
    """Forward one training's metrics.jsonl rows at their run-wide step; returns how many rows were logged."""
    from polar_mitm.train.metrics import read_metrics

    if not metrics_file.exists():
        return 0
    rows = read_metrics(metrics_file)
    for row in rows:
        tracker.log(numeric_metrics(row, "train"), step=int(row.get("run_step", row["step"])))
    return len(rows)
