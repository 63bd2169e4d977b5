"""`polar-mitm report flows/ merged/ runs/grpo`: one report for a hand-run rollout → merge → grpo.

Each folder's kind is found from what it holds (`input_kinds`): records (record shards, a live journal or the
gateway's `_engine.json`), rollout (`rewards.parquet`), merged (`_summary.json`), grpo (`metrics.jsonl`); one folder
may be several (a loop's `iter-K`). The folders' artifacts become one stage, so the page shows the sections each
gives — records and sessions, merge statistics and the token viewer, training curves — as a single stage directory
holding them all would. One folder is read as it always was (`collect_run`), a loop run included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from polar_mitm.report.collect import ReportInput, RunData, Stage, collect_run, read_stage
from polar_mitm.storage.location import InputNotFound
from polar_mitm.storage.run_layout import ITERATION_GLOB, REWARDS_FILE, iteration_index
from polar_mitm.user_errors import UserInputError

COMBINED_LABEL = "combined"
INPUT_KINDS = ("records", "rollout", "merged", "grpo")  # in pipeline order
# (Stage attribute, the kind it comes from): each may come from one input only.
ARTIFACTS = (("flows_dir", "records"), ("merged_dir", "merged"), ("train_dir", "grpo"))


def collect_inputs(paths: Sequence[str | Path]) -> RunData:
    """One folder: `collect_run`. Several: their artifacts as one stage (see the module docstring); a folder that is
    none of the kinds, a loop run among them, or two folders of one kind is a user error naming the folder."""
    paths = [Path(p) for p in paths]
    if len(paths) == 1:
        return collect_run(paths[0])
    parts = [input_stage(path) for path in paths]
    combined = Stage(label=COMBINED_LABEL, root=paths[0])
    for attribute, kind in ARTIFACTS:
        owner = only_one(parts, kind, lambda stage, a=attribute: getattr(stage, a) is not None)
        if owner is not None:
            setattr(combined, attribute, getattr(owner, attribute))
            if kind == "merged":
                combined.merge_summary = owner.merge_summary
            if kind == "grpo":
                combined.metrics = owner.metrics
    # A rollout's rewards.parquet (with each session's status) wins over the rewards joined into merged sequences.
    rollout = only_one(parts, "rollout", lambda stage: (stage.root / REWARDS_FILE).exists())
    with_rewards = rollout or next((stage for stage in parts if stage.rewards), None)
    combined.rewards = with_rewards.rewards if with_rewards is not None else []
    inputs = [ReportInput(stage.root, input_kinds(stage)) for stage in parts]
    return RunData(root=paths[0], kind="combined", stages=[combined], inputs=inputs)


def input_stage(path: Path) -> Stage:
    """The artifacts of one input of a combined report; raises when it holds none of the kinds."""
    if not path.is_dir():
        raise InputNotFound(f"{path} is not a directory")
    if any(p.is_dir() and iteration_index(p) is not None for p in path.glob(ITERATION_GLOB)):
        raise UserInputError(f"{path} is a loop run: report it on its own (`polar-mitm report {path}`)")
    stage = read_stage(path, path.name)
    if not input_kinds(stage):
        raise InputNotFound(
            f"{path}: not a records, rollout, merged or grpo folder "
            "(no record shards, _engine.json, rewards.parquet, _summary.json or metrics.jsonl)"
        )
    return stage


def input_kinds(stage: Stage) -> tuple[str, ...]:
    """What one input holds: records | rollout | merged | grpo, in pipeline order."""
    held = {
        "records": stage.flows_dir is not None,
        "rollout": (stage.root / REWARDS_FILE).exists(),
        "merged": stage.merged_dir is not None,
        "grpo": stage.train_dir is not None,
    }
    return tuple(kind for kind in INPUT_KINDS if held[kind])


def only_one(parts: list[Stage], kind: str, holds: Callable[[Stage], bool]) -> Stage | None:
    """The input that holds `kind`, None when none does; two that do are a user error (which one is meant?)."""
    owners = [stage for stage in parts if holds(stage)]
    if len(owners) > 1:
        raise UserInputError(
            f"{owners[0].root} and {owners[1].root} are both {kind} folders: give one of each kind"
        )
    return owners[0] if owners else None
