"""What a `polar-mitm loop` run leaves on disk so that `--resume` can carry it on after any kill.

A loop run lives for hours; the process may be SIGKILLed at any point (an OOM, a pre-empted node, the end of a Slurm
allocation). Everything `--resume` needs is therefore written as it happens, each file so that a kill leaves either
the old or the new content, never half of one:

- `RUN/run.json`: the command line and the whole `LoopConfig`, so `--resume -o RUN` needs nothing else;
- `RUN/iter-K/state.json`: the iteration's stage markers (rollout, merge, train, push, eval, done), each with what a
  resumed run needs of that stage, and the stage running now (`running`); replaced atomically (temp file + rename);
- `RUN/iter-K/sessions.jsonl`: one line per finished session (its rewards-file row), appended and fsynced when the
  session finishes: an interrupted rollout keeps them and re-runs only the others, under new session ids;
- `RUN/loop.json`: the finished iterations' figures, rewritten after every iteration (an iteration is done exactly
  when its row is there);
- `RUN/events.jsonl`: start, resume, iteration_done, eval_done and finished, one JSON object per line.

The optimizer's own state (`RUN/trainer-state`) is saved atomically by train/continuation.py.

A run resumes in the folder `--resume -o RUN` names, wherever it was started: paths into the run are stored relative
to it, and the absolute ones older runs stored (and run.json's `run_dir`) are read under RUN (`in_run_dir`), so a
copy never writes into the original nor reads from it. Every file above is checked before a resume starts anything
(saved_state.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

from polar_mitm.rollout.runner import Rollout, RolloutSummary, SessionRun
from polar_mitm.storage.json_lines import append_line, read_lines
from polar_mitm.storage.run_layout import (
    EVENTS_FILE,
    RUN_RECORD,
    SESSIONS_FILE,
    STATE_FILE,
    iteration_dir,
)
from polar_mitm.tasks.task_file import Task

# Options that may differ on --resume: they change what is kept, not what is trained (an engine restarted at another
# address is given the last trained weights at start).
RESUMABLE_CHANGES = ("resume", "yes", "keep_checkpoints", "engine_url", "gateways", "log_format")


class RunRecordError(ValueError):
    """A `--resume` that cannot continue the recorded run (no record, or options that contradict it)."""


def write_json_atomic(path: Path, value: Any) -> None:
    """`path` holds the old JSON or the new one, whenever the process is killed."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as sink:
        sink.write(json.dumps(value, indent=2))
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(tmp, path)


# -- the run record ------------------------------------------------------------------------------------------------


def to_json_value(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value.resolve())
    if isinstance(value, dict):
        return {k: to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    return value


def config_to_json(cfg: Any) -> dict[str, Any]:
    """A config dataclass as JSON (paths absolute, enums by value)."""
    return {f.name: to_json_value(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def record_run(run_dir: Path, cfg: Any, argv: list[str] | None = None) -> None:
    """`RUN/run.json`: the command that started the run and its whole config."""
    record = {
        "argv": list(sys.argv if argv is None else argv),
        "cwd": os.getcwd(),
        "started": time.time(),
        "config": config_to_json(cfg),
    }
    write_json_atomic(run_dir / RUN_RECORD, record)


def rebased_config_json(config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """A recorded config for the run directory it is in now: `run_dir` is the given one, and every path that
    pointed into the recorded run directory points to the same place under it (a copy of a run must neither write
    into the original nor read from it)."""
    recorded = config.get("run_dir")
    return {
        **{
            name: str(in_run_dir(value, Path(run_dir), Path(recorded)))
            if isinstance(value, str) and isinstance(recorded, str) and Path(value).is_absolute()
            else value
            for name, value in config.items()
        },
        "run_dir": str(Path(run_dir).resolve()),
    }


def in_run_dir(value: str | Path, run_dir: Path, recorded_run_dir: Path) -> Path:
    """A path the run stored (relative to its run directory, or absolute as older runs stored them) in `run_dir`
    now: relative ones under it, absolute ones inside the recorded run directory moved to the same place under it,
    others (the starting model, a task file) as they are."""
    path = Path(value)
    if not path.is_absolute():
        return run_dir / path
    if path.is_relative_to(recorded_run_dir):
        return run_dir / path.relative_to(recorded_run_dir)
    return path


def stored_path(path: Path, run_dir: Path) -> str:
    """How a path the run keeps is written: relative to the run directory when inside it (the run can be moved)."""
    return str(path.relative_to(run_dir)) if path.is_relative_to(run_dir) else str(path)


def recorded_run_dir(run_dir: Path) -> Path:
    """Where RUN/run.json says the run was started (another folder when the run was copied or moved since)."""
    return Path(json.loads((Path(run_dir) / RUN_RECORD).read_text())["config"]["run_dir"])


def config_differences(recorded: Any, wanted: dict[str, Any]) -> list[str]:
    """`name recorded→wanted` for each of `wanted`'s settings (field name → value) that the recorded run differs in
    (`grpo` compared per trainer field)."""
    differences = []
    for name, value in wanted.items():
        if name in RESUMABLE_CHANGES:
            continue
        if name == "grpo":
            before = recorded.grpo
            for field, new in value.items():
                if to_json_value(before.get(field)) != to_json_value(new):
                    differences.append(f"{field} {before.get(field)!r}→{new!r}")
            continue
        old = getattr(recorded, name)
        if to_json_value(old) != to_json_value(value):
            differences.append(f"{name} {to_json_value(old)!r}→{to_json_value(value)!r}")
    return differences


def resumed_config(run_dir: Path, recorded: Any, given: dict[str, Any]) -> Any:
    """The recorded run's config (in `run_dir`, where it is now), with `resume` (and the settings that may change)
    from `given`; any other setting of `given` that differs from the record is refused, all in one line."""
    differences = config_differences(recorded, given)
    if differences:
        raise RunRecordError(
            f"--resume: {run_dir} was started with other settings ({'; '.join(differences)}): give only "
            "--resume -o RUN, or start a new run directory"
        )
    changes = {name: given[name] for name in RESUMABLE_CHANGES if name in given}
    return dataclasses.replace(recorded, **{**changes, "resume": True})


def append_event(
    run_dir: Path, event: str, iteration: int | None = None, stage: str | None = None, **extra: Any
) -> None:
    """One line of `RUN/events.jsonl`."""
    row = {"event": event, "iteration": iteration, "stage": stage, "time": time.time(), **extra}
    append_line(run_dir / EVENTS_FILE, row)


# -- per-iteration stage markers -----------------------------------------------------------------------------------


class IterationState:
    """`RUN/iter-K/state.json`: which stages of iteration K are done (with their figures) and which one runs."""

    STAGES = ("rollout", "merge", "train", "push", "eval", "done")

    def __init__(self, directory: Path, iteration: int) -> None:
        self.path = directory / STATE_FILE
        self.iteration = iteration
        self._lock = threading.Lock()
        self.data: dict[str, Any] = {"iteration": iteration, "running": None, "stages": {}}
        if self.path.exists():
            self.data = json.loads(self.path.read_text())

    def done(self, stage: str) -> bool:
        return stage in self.data["stages"]

    def info(self, stage: str) -> dict[str, Any]:
        return self.data["stages"][stage]

    def begin(self, stage: str) -> None:
        """`stage` runs now (what a test or a person watching the run sees)."""
        with self._lock:
            self.data["running"] = stage
            self.data.setdefault("started", {})[stage] = time.time()
            self._write()

    def finish(self, stage: str, **info: Any) -> None:
        with self._lock:
            self.data["stages"][stage] = {"time": time.time(), **info}
            self.data["running"] = None
            self._write()

    def first_unfinished(self) -> str | None:
        return next((s for s in self.STAGES if not self.done(s)), None)

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.data)


# -- finished sessions of a rollout --------------------------------------------------------------------------------


class SessionJournal:
    """`iter-K/sessions.jsonl`: each session's rewards-file row, appended once, as it finishes."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / SESSIONS_FILE
        self._lock = threading.Lock()
        self.written: set[str] = {row["session_id"] for row in read_lines(self.path)}

    def add(self, rows: list[dict[str, Any]]) -> None:
        with self._lock:
            for row in rows:
                if row["session_id"] not in self.written:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    append_line(self.path, row)
                    self.written.add(row["session_id"])

    def rows(self) -> list[dict[str, Any]]:
        return read_lines(self.path)


def session_row(session: SessionRun) -> dict[str, Any]:
    """A finished session as its rewards-file row."""
    return RolloutSummary([session], 0.0, 0.0).table().to_pylist()[0]


def session_from_row(row: dict[str, Any], tasks: dict[str, Task]) -> SessionRun:
    """A finished session back from its rewards-file row (the task looked up by id)."""
    spans = {
        stage: (0.0, row[f"{stage if stage != 'post' else 'eval'}_seconds"])
        for stage in ("init", "run", "post")
        if row.get(f"{stage if stage != 'post' else 'eval'}_seconds") is not None
    }
    return SessionRun(
        task=tasks[row["task_id"]],
        index=row["sample_index"],
        session_id=row["session_id"],
        stage="done",
        status=row["status"],
        end=row.get("end"),  # null in a rewards file written before ends were recorded
        reward=row["reward"],
        exit_code=row["exit_code"],
        eval_output=row["eval_output"] or "",
        spans=spans,
    )


def journal_finished(rollout: Rollout, directory: Path) -> None:
    """From now on, each session of `rollout` that finishes is appended to `directory/sessions.jsonl` (before the
    rollout's own `on_update` sees it)."""
    journal, shown = SessionJournal(directory), rollout.on_update

    def on_update(sessions: list[SessionRun]) -> None:
        journal.add([session_row(s) for s in sessions if s.stage == "done" and s.status])
        shown(sessions)

    rollout.on_update = on_update


def renumbered(sessions: Iterable[SessionRun], kept: Iterable[SessionRun]) -> list[SessionRun]:
    """Re-run sessions numbered after the kept ones of their task (sample indices stay unique per group)."""
    taken: dict[str, int] = {}
    for s in kept:
        taken[s.task.task_id] = max(taken.get(s.task.task_id, 0), s.index + 1)
    out = []
    for s in sessions:
        s.index = taken.get(s.task.task_id, 0)
        taken[s.task.task_id] = s.index + 1
        out.append(s)
    return out


# -- pruning ------------------------------------------------------------------------------------------------------

# Under iter-K/train: what only a resume from iteration K (or an engine push of it) would read.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "engine-weights", "merged", "checkpoint-*")


def prune_checkpoints(run_dir: Path, keep: int, last_trained: int) -> list[Path]:
    """`--keep-checkpoints N`: remove the weights of the trainings before the last N that hold any (the newest is
    what a resume starts from; a training skipped for having nothing to learn holds none); metrics, configs and
    the data stay. Returns what was removed."""
    removed: list[Path] = []
    kept = 0
    for k in range(last_trained, -1, -1):
        train = iteration_dir(run_dir, k) / "train"
        weights = [path for pattern in WEIGHT_PATTERNS for path in train.glob(pattern)]
        if not weights:
            continue
        if kept < max(keep, 1):
            kept += 1
            continue
        for path in weights:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed
