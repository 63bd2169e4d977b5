"""What went into a training run and how stale it is: `DataStats` (written next to the run as data_stats.json and
printed by `polar-mitm grpo`) and the weight-version distance the trainer reports per row.

Kept apart from the row building (data.py) so the CLI, the loop and the report read one declaration of the counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class DataStats:
    """What went into training and what was left out (written next to the run as data_stats.json)."""

    sequences_read: int = 0
    sequences_used: int = 0
    sessions: int = 0
    groups: int = 0
    unrewarded_sessions: int = 0
    singleton_groups: int = 0
    zero_variance_groups: int = 0
    mixed_reward_sessions: int = 0
    truncated: int = 0
    dropped_no_sampled_tokens: int = 0
    group_sizes: dict[int, int] = field(default_factory=dict)
    group_size_mismatches: int = 0
    tokens: int = 0
    sampled_tokens: int = 0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    weight_versions: dict[str, int] = field(default_factory=dict)
    # Sampling: turns per scoring temperature ("unknown": v1 data, scored at the trainer's --temperature), and what
    # left the loss because its logprobs are not the sampling policy's (greedy / top-p, top-k, min-p truncation).
    temperatures: dict[str, int] = field(default_factory=dict)
    unknown_temperature_sequences: int = 0
    excluded_greedy_turns: int = 0
    excluded_truncated_turns: int = 0
    excluded_constrained_turns: int = 0
    excluded_sampled_tokens: int = 0
    dropped_excluded_sampling: int = 0  # sequences with no sampled token left after the exclusions
    sequences_per_session_max: int = 0
    # Dynamic sampling (train/batching.py): groups whose advantages are all 0 leave the batches unless kept.
    zero_advantage_groups: int = 0
    zero_advantage_sequences: int = 0
    zero_advantage_tokens: int = 0
    zero_advantage_kept: bool = (
        False  # set by the trainer: --keep-zero-advantage-groups, or nothing else was left
    )
    # Set by the trainer from its batch plan: groups larger than a chunk of an optimizer step, trained in parts.
    split_groups: int = 0
    uncentred_parts: int = 0  # parts of one session or one reward, which keep the group's advantages

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def newest_weight_version(rows: Sequence[dict[str, Any]]) -> str | None:
    """The newest `weight_version_max` among the rows (numeric versions compare as numbers)."""
    versions = {r.get("weight_version_max") or r.get("weight_version") for r in rows} - {None}
    if not versions:
        return None
    numeric = [v for v in versions if str(v).isdigit()]
    return max(numeric, key=int) if numeric else sorted(versions)[-1]


def version_distance(current: str | None, recorded: str | None) -> int:
    """How many weight updates separate `recorded` from `current`: the difference of numeric versions, else 0 if
    they are equal (or unknown) and 1 if they differ."""
    if current is None or recorded is None or current == recorded:
        return 0
    if str(current).isdigit() and str(recorded).isdigit():
        return max(0, int(current) - int(recorded))
    return 1
