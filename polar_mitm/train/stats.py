"""What went into a training run and how stale it is: `DataStats` (written next to the run as data_stats.json and
printed by `polar-mitm grpo`) and the weight-version distance the trainer reports per row.

Kept apart from the row building (data.py) so the CLI, the loop and the report read one declaration of the counts.
"""

from __future__ import annotations

import re
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


@dataclass(frozen=True)
class WeightVersion:
    """A `weight_version` as the engine's label and a count of weight updates, so that two versions of one run
    compare by distance whatever the engine writes: `12` (polar-mitm serve, numeric pushes) is ("", 12); an
    engine's own label with the trainer's steps after it, `default+3` (SGLang's and vLLM's `default` once
    `policy_weight_version` advanced it), is ("default", 3) and `default` ("default", 0); a number at the end,
    `step-120` or `v3`, is ("step-", 120) or ("v", 3); anything else is (itself, 0)."""

    label: str
    number: int

    @classmethod
    def parse(cls, version: str) -> WeightVersion:
        text = str(version)
        base, plus, steps = text.rpartition("+")
        if plus and base and steps.isdigit():
            inner = cls.parse(base)
            return cls(inner.label, inner.number + int(steps))
        match = _TRAILING_NUMBER.match(text)
        if match:
            return cls(match["label"], int(match["number"]))
        return cls(text, 0)


_TRAILING_NUMBER = re.compile(r"^(?P<label>.*?)(?P<number>\d+)$")


def advanced_version(version: str | None, steps: int) -> str:
    """`version` after `steps` more weight updates: a number counts on (`12` → `15`), a label carries the count
    after a `+` (`default` → `default+3`, `default+3` → `default+5`, `step-12` → `step-12+3`)."""
    if version is None:
        return str(steps)
    text = str(version)
    if steps == 0:
        return text
    if text.isdigit():
        return str(int(text) + steps)
    base, plus, count = text.rpartition("+")
    if plus and base and count.isdigit():
        return f"{base}+{int(count) + steps}"
    return f"{text}+{steps}"


def newest_weight_version(rows: Sequence[dict[str, Any]]) -> str | None:
    """The newest `weight_version_max` among the rows: the highest count where they share one label (see
    `WeightVersion`), else the highest numeric one, else the last by name."""
    versions = {r.get("weight_version_max") or r.get("weight_version") for r in rows} - {None}
    if not versions:
        return None
    parsed = {v: WeightVersion.parse(v) for v in versions}
    if len({p.label for p in parsed.values()}) == 1:
        return max(versions, key=lambda v: (parsed[v].number, str(v)))
    numeric = [v for v in versions if str(v).isdigit()]
    return max(numeric, key=int) if numeric else sorted(versions)[-1]


def version_distance(current: str | None, recorded: str | None) -> int:
    """How many weight updates separate `recorded` from `current` (never negative): the difference of their
    counts when they share a label (`WeightVersion`: numeric versions, `default+N`, a trailing number), 0 if they
    are equal or one is unknown, and 1 for two versions of different labels (no distance can be read)."""
    if current is None or recorded is None or current == recorded:
        return 0
    now, then = WeightVersion.parse(current), WeightVersion.parse(recorded)
    if now.label == then.label:
        return max(0, now.number - then.number)
    return 1
