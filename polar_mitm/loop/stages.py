"""What one stage of a loop iteration hands the next: rollout → merge → training, each a named, typed result.

The loop's stages run in turn or (`--overlap`) in two threads, and each may come back from its marker in
`iter-K/state.json` on `--resume` instead of running; either way the next stage gets one of these, so what a stage
produces is read by name (`rolled.flows`, `trained.weight_version`), never by its place in a tuple.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_mitm.loop.figures import MergeFigures
from polar_mitm.rollout.runner import RolloutSummary


@dataclass(frozen=True)
class RolloutOutcome:
    """An iteration's rollout: its sessions with their rewards, where its records and rewards file are, and how long
    it took (as its marker recorded it, on a resume)."""

    summary: RolloutSummary
    flows: Path  # iter-K/flows: the records the merge joins
    rewards: Path  # iter-K/rewards.parquet
    seconds: float


@dataclass(frozen=True)
class MergeOutcome:
    """An iteration's merge: the figures the loop keeps of it (the sequences are under iter-K/merged)."""

    figures: MergeFigures
    seconds: float


@dataclass(frozen=True)
class IterationData:
    """What iteration K trains on: its rollout and the merge of its records (`--overlap` prepares it ahead)."""

    rollout: RolloutOutcome
    merge: MergeOutcome


@dataclass(frozen=True)
class TrainedModel:
    """An iteration's training: the weights it saved and the version the engine numbers them by."""

    model_dir: Path  # where the next full-weights training starts (LoRA: the merged weights)
    weight_version: str | None  # None: no engine numbered them (a training driven without one)
    seconds: float
    # every group was flat (equal rewards): no optimizer step, the weights stayed
    skipped: bool = False
    # the weights the training started from: the trained calls' staleness is measured against them
    base_weight_version: str | None = None
    # what pushing them to the engine did (PushReport's fields), None when nothing was pushed
    push: dict[str, Any] | None = None
