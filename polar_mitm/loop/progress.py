"""What the loop shows while a stage runs: a `LoopProgress` receives stage starts and progress.

The loop itself only calls `stage(...)` and `advance(...)`; `RichLoopProgress` draws them as one Rich progress
line ("iteration 2/4 · rollout ━━━━━━ 7/12 sessions 0:00:21"). `quiet_libraries` turns off the library progress
bars and warnings that would otherwise print between our lines — at their source, by the libraries' own switches.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from polar_mitm.log_format import EventLog

# What each stage counts, for the progress line.
STAGE_UNITS = {"rollout": "sessions", "merge": "", "train": "steps", "evaluate": "sessions"}


class LoopProgress(Protocol):
    """Receives the loop's stages as they start and advance (all methods may be called from any thread)."""

    def stage(self, iteration: int, name: str, total: int | None = None) -> None: ...

    def advance(self, completed: int, total: int | None = None) -> None: ...


class NoProgress:
    """Shows nothing (the default)."""

    def stage(self, iteration: int, name: str, total: int | None = None) -> None:
        pass

    def advance(self, completed: int, total: int | None = None) -> None:
        pass


class RichLoopProgress:
    """One transient Rich progress line for the stage that is running; use as a context manager."""

    def __init__(self, console: Console, iterations: int) -> None:
        self.iterations = iterations
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[unit]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task("starting", total=None, unit="")

    def __enter__(self) -> RichLoopProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def stage(self, iteration: int, name: str, total: int | None = None) -> None:
        label = (
            f"iteration {iteration + 1}/{self.iterations}" if iteration < self.iterations else "final rollout"
        )
        self.progress.reset(
            self.task,
            total=total,
            completed=0,
            description=f"{label} · {name}",
            unit=STAGE_UNITS.get(name, ""),
        )

    def advance(self, completed: int, total: int | None = None) -> None:
        if total is not None:
            self.progress.update(self.task, total=total)
        self.progress.update(self.task, completed=completed)


class LineLoopProgress:
    """The same stages as events (`--log-format lines|json`, or output that is not a terminal): one when a stage
    starts, then at most one per `every` seconds as it advances, and one at each 25% of its total."""

    def __init__(self, log: EventLog, iterations: int, every: float = 30.0) -> None:
        self.log, self.iterations, self.every = log, iterations, every
        self.name, self.iteration, self.total = "", 0, None
        self.last_said, self.last_quarter = 0.0, 0

    def stage(self, iteration: int, name: str, total: int | None = None) -> None:
        self.name, self.iteration, self.total = name, iteration, total
        self.last_said, self.last_quarter = time.monotonic(), 0
        of = f" ({' '.join(filter(None, [str(total), STAGE_UNITS.get(name, '')]))})" if total else ""
        self.log.event("stage", f"{self._label()} · {name}{of}", iteration=iteration, stage=name, total=total)

    def advance(self, completed: int, total: int | None = None) -> None:
        self.total = total if total is not None else self.total
        quarter = int(4 * completed / self.total) if self.total else 0
        now = time.monotonic()
        if quarter <= self.last_quarter and now - self.last_said < self.every:
            return
        self.last_said, self.last_quarter = now, max(quarter, self.last_quarter)
        of = f"/{self.total}" if self.total else ""
        self.log.event(
            "progress",
            f"{self._label()} · {self.name} {completed}{of} {STAGE_UNITS.get(self.name, '')}".rstrip(),
            iteration=self.iteration,
            stage=self.name,
            completed=completed,
            total=self.total,
        )

    def _label(self) -> str:
        if self.iteration < self.iterations:
            return f"iteration {self.iteration + 1}/{self.iterations}"
        return "final rollout"


def quiet_libraries() -> None:
    """Turn off library output that says nothing to the user of a live display, by each library's own switch:
    transformers' "Loading weights"/"Writing model shards" bars and datasets' map/filter bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:  # the capture-only install has no datasets: nothing to silence
        pass


def trainer_progress_callback(progress: LoopProgress):
    """A transformers TrainerCallback that reports optimizer steps to `progress`."""
    from transformers import TrainerCallback

    class StepProgress(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            progress.advance(0, state.max_steps)

        def on_step_end(self, args, state, control, **kwargs):
            progress.advance(state.global_step, state.max_steps)

    return StepProgress()
