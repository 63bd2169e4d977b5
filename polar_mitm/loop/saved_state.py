"""Every file `polar-mitm loop --resume` reads, checked in one place before anything starts.

A run directory outlives the process that wrote it: it can be cut by a full disk, edited by hand, or tampered with
by anything that runs as the same user. `check_saved_run` reads each file a resume will read (run_state.py lists
them) and validates it against the shape the loop writes, so that a bad one ends the command with one line naming
the file (and the line, for JSON lines) before an engine or a gateway starts, instead of a traceback hours later.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.evaluation import EvalResult
from polar_mitm.loop.figures import IterationStats, MergeFigures
from polar_mitm.loop.run_state import RunRecordError, rebased_config_json
from polar_mitm.storage.run_layout import (
    ITERATION_GLOB,
    LOOP_FILE,
    RUN_RECORD,
    RUN_STATE_DIR,
    RUN_STATE_FILE,
    SESSIONS_FILE,
    SKIPPED_TRAINING_FILE,
    START_EVAL_DIR,
    STATE_FILE,
)
from polar_mitm.tasks.task_file import TaskFileError, load_tasks

RESTORE = "restore it from a copy of the run, or start a new run directory"
# LoopConfig's counts that no run can have fewer of (a tampered `group_size: 0` would train on empty groups).
AT_LEAST = {
    "iterations": 1,
    "group_size": 1,
    "concurrency": 1,
    "gateways": 1,
    "max_tokens": 1,
    "per_device_batch_size": 1,
    "train_processes": 1,
    "eval_every": 1,
    "eval_samples": 1,
    "overlap": 0,
}


class SavedStateError(RunRecordError):
    """A file of the run directory that a resume cannot use; the message is the one line to show."""


class Saved(BaseModel):
    model_config = ConfigDict(extra="allow")  # keys a stage marker adds later do not make a run unresumable


def exactly(cls: type) -> Any:
    """The dataclass `cls`, as the loop builds it back (`cls(**value)`): an unknown key would be a TypeError."""
    names = {f.name for f in dataclasses.fields(cls)}

    def known_keys(value: Any) -> Any:
        if isinstance(value, dict) and (unknown := sorted(set(value) - names)):
            raise ValueError(f"unknown field(s) {unknown}")
        return value

    return Annotated[cls, BeforeValidator(known_keys)]


SavedEval = exactly(EvalResult)
SavedMergeFigures = exactly(MergeFigures)


def loop_row(value: Any) -> Any:
    """A row of loop.json as stats_from_json reads it: IterationStats' keys (others are left out), its held-out
    evaluation built back whole."""
    if isinstance(value, dict) and isinstance(value.get("eval"), dict):
        try:
            TypeAdapter(SavedEval).validate_python(value["eval"])
        except ValidationError as exc:
            raise ValueError(f"eval.{problem(exc)}") from None
    return value


LoopRow = Annotated[IterationStats, BeforeValidator(loop_row)]


class RunRecord(Saved):
    argv: list[str]
    cwd: str
    started: float
    config: dict[str, Any]


class RolloutDone(Saved):
    seconds: float
    replaced_groups: int = 0


class MergeDone(Saved):
    figures: SavedMergeFigures
    seconds: float


class TrainDone(Saved):
    model_dir: str
    weight_version: str | None
    seconds: float
    base_weight_version: str | None = None
    skipped: bool = False


class PushDone(Saved):
    weight_version: str | None


class EvalDone(Saved):
    result: SavedEval


class StagesDone(BaseModel):
    rollout: RolloutDone | None = None
    merge: MergeDone | None = None
    train: TrainDone | None = None
    push: PushDone | None = None
    eval: EvalDone | None = None
    done: Saved | None = None


class IterationStateFile(Saved):
    """iter-K/state.json (run_state.IterationState)."""

    iteration: int
    running: Literal["rollout", "merge", "train", "push", "eval", "done"] | None
    stages: StagesDone
    started: dict[str, float] = {}


class SessionLine(Saved):
    """A line of iter-K/sessions.jsonl: a finished session's rewards-file row (run_state.session_row)."""

    session_id: str = Field(min_length=1)
    task_id: str
    sample_index: int = Field(ge=0)
    status: str
    reward: float | None
    exit_code: int | None
    eval_output: str | None
    init_seconds: float | None = None
    run_seconds: float | None = None
    eval_seconds: float | None = None


class SkippedTraining(Saved):
    """iter-K/train/skipped.json."""

    model_dir: str
    weight_version: str | None
    sequences: int


class RunStateFile(BaseModel):
    """trainer-state/run_state.json: train/continuation.RunState's fields (mirrored here: importing the trainer
    takes torch, seconds before the answer; no other key: RunState.load passes them all to RunState)."""

    model_config = ConfigDict(extra="forbid")

    trainings: int = Field(default=0, ge=0)
    optimizer_steps: int = Field(default=0, ge=0)
    schedule_steps: int | None = None
    save_seconds: float = 0.0
    state_bytes: int = 0
    policy_weight_version: str | None = None
    dr_grpo_constant: int | None = Field(
        default=None, ge=1
    )  # the run's loss normalisers (train/normalisers.py)
    loss_tokens_per_step: float | None = Field(default=None, gt=0)


def problem(exc: ValidationError) -> str:
    """A validation error's first problem, as `where: what`."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SavedStateError(f"--resume: {path} is not readable JSON ({exc}): {RESTORE}") from None


def validated(kind: Any, path: Path) -> Any:
    """`path`'s JSON as `kind` (a model, or a type pydantic validates)."""
    data = read_json(path)
    try:
        return TypeAdapter(kind).validate_python(data)
    except ValidationError as exc:
        raise SavedStateError(f"--resume: {path}: {problem(exc)}: {RESTORE}") from None


def saved_config(run_dir: Path) -> LoopConfig:
    """RUN/run.json's config, validated, with the paths that pointed into the recorded run directory moved under
    `run_dir` (a copied or moved run resumes where it is)."""
    path = run_dir / RUN_RECORD
    if not path.exists():
        raise SavedStateError(f"--resume: {path} does not exist (no run was started in {run_dir})")
    record = validated(RunRecord, path)
    started_in = record.config.get("run_dir")
    if not (isinstance(started_in, str) and Path(started_in).is_absolute()):
        raise SavedStateError(
            f"--resume: {path}: config.run_dir is {started_in!r}, not the absolute path the run was started in: "
            f"{RESTORE}"
        )
    try:
        cfg = TypeAdapter(LoopConfig).validate_python(rebased_config_json(record.config, run_dir))
    except ValidationError as exc:
        raise SavedStateError(f"--resume: {path}: config.{problem(exc)}: {RESTORE}") from None
    for name, least in AT_LEAST.items():
        value = getattr(cfg, name)
        if value is not None and value < least:
            raise SavedStateError(
                f"--resume: {path}: config.{name} is {value!r}, at least {least} is needed: {RESTORE}"
            )
    return cfg


def check_sessions(path: Path, task_ids: set[str] | None) -> None:
    """Each whole line of a sessions.jsonl (a torn line, left by a kill mid-append, is skipped as the loop skips
    it)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SavedStateError(f"--resume: {path} is not readable ({exc}): {RESTORE}") from None
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        where = f"--resume: {path} line {number}"
        try:
            session = SessionLine.model_validate(row)
        except ValidationError as exc:
            raise SavedStateError(
                f"{where}: {problem(exc)}: remove the line (that session runs again), or {RESTORE}"
            ) from None
        if task_ids is not None and session.task_id not in task_ids:
            raise SavedStateError(
                f"{where}: task {session.task_id!r} is not in the task file: remove the line (that session runs "
                f"again), or {RESTORE}"
            )


def check_saved_run(run_dir: Path) -> LoopConfig:
    """The run's recorded config, after every file a resume of `run_dir` reads was found usable; SavedStateError
    (one line) otherwise."""
    run_dir = Path(run_dir).resolve()
    cfg = saved_config(run_dir)
    try:
        task_ids = {task.task_id for task in load_tasks(cfg.tasks)}
    except (OSError, TaskFileError):
        task_ids = None  # the task file itself is checked (and reported) with the command's other inputs
    if (run_dir / LOOP_FILE).exists():
        validated(list[LoopRow], run_dir / LOOP_FILE)
    for state in (run_dir / RUN_STATE_DIR, run_dir / f"{RUN_STATE_DIR}.new"):
        if (state / RUN_STATE_FILE).exists():
            validated(RunStateFile, state / RUN_STATE_FILE)
    if (run_dir / START_EVAL_DIR / "eval.json").exists():
        validated(SavedEval, run_dir / START_EVAL_DIR / "eval.json")
    for it in sorted(run_dir.glob(ITERATION_GLOB)):
        if (it / STATE_FILE).exists():
            validated(IterationStateFile, it / STATE_FILE)
        if (it / SESSIONS_FILE).exists():
            check_sessions(it / SESSIONS_FILE, task_ids)
        if (it / "train" / SKIPPED_TRAINING_FILE).exists():
            validated(SkippedTraining, it / "train" / SKIPPED_TRAINING_FILE)
    return cfg
