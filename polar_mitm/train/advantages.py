"""Group-relative advantages (GRPO's baseline), per session, over whole groups and before training.

Rewards are fixed once recorded, so the group baseline is computed here over whole groups — not inside a batch,
where a group may be split. A GRPO group is a `task_id`; its members are sessions (one rollout each), and every
sequence of a session shares the session's reward and advantage.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from polar_mitm.storage.merged import MergedSequence

AdvantageEstimator = Literal["mean_std", "leave_one_out"]
RewardScaling = Literal["group", "batch", "none"]
STD_EPS = 1e-4  # as TRL: keeps a near-zero-variance group from blowing up
ZERO_VARIANCE_TOL = 1e-9


@dataclass
class GroupAdvantages:
    """Per-session rewards and advantages, plus what was left out and why."""

    reward: dict[str, float]
    advantage: dict[str, float]
    group_of: dict[str, str | None]
    zero_variance_groups: int = 0
    singleton_groups: int = 0
    unrewarded_sessions: int = 0
    mixed_reward_sessions: int = 0
    group_sizes: dict[int, int] = field(default_factory=dict)  # sessions per group → number of groups


def session_rewards(
    sequences: Sequence[MergedSequence],
) -> tuple[dict[str, float], dict[str, str | None], int]:
    """One reward and group per session: (reward by session, task_id by session, sessions whose rows disagree).

    Rewards are joined per session, so its rows should agree; if they do not, the mean is used and counted.
    """
    rewards: dict[str, list[float]] = defaultdict(list)
    group_of: dict[str, str | None] = {}
    for seq in sequences:
        group_of.setdefault(seq.session_id, seq.task_id)
        if seq.reward is not None and math.isfinite(seq.reward):
            rewards[seq.session_id].append(float(seq.reward))
    mixed = sum(1 for values in rewards.values() if max(values) - min(values) > ZERO_VARIANCE_TOL)
    return {s: sum(v) / len(v) for s, v in rewards.items()}, group_of, mixed


def group_advantages(
    sequences: Sequence[MergedSequence],
    *,
    estimator: AdvantageEstimator = "mean_std",
    scale_rewards: RewardScaling = "group",
) -> GroupAdvantages:
    """Group-relative advantages per session, over the sessions of each `task_id`.

    `mean_std`: (r - group mean), divided by the group std (`scale_rewards="group"`, TRL's default), by the std of
    all rewards (`"batch"`) or not at all (`"none"`, Dr. GRPO). `leave_one_out` (RLOO): r - mean of the *other*
    sessions' rewards, unscaled. Groups whose rewards are all equal, and single-session groups, get exactly 0.
    Sessions without a task_id are their own (singleton) group; sessions without a reward are left out.
    """
    if estimator not in get_args(AdvantageEstimator) or scale_rewards not in get_args(RewardScaling):
        raise ValueError(f"unknown advantage estimator {estimator!r} or reward scaling {scale_rewards!r}")
    reward, group_of, mixed = session_rewards(sequences)
    members: dict[str, list[str]] = defaultdict(list)
    singleton = 0
    for session in reward:
        task = group_of[session]
        if task is None:
            singleton += 1
            continue
        members[task].append(session)
    all_rewards = list(reward.values())
    batch_std = sample_std(all_rewards)
    advantage = {s: 0.0 for s in reward}
    zero_variance = 0
    for sessions in members.values():
        values = [reward[s] for s in sessions]
        if len(values) < 2:
            singleton += 1
            continue
        if max(values) - min(values) <= ZERO_VARIANCE_TOL:
            zero_variance += 1  # an exact 0: float noise in (r - mean) / eps would otherwise leak a gradient
            continue
        total, n = sum(values), len(values)
        scale = {"group": sample_std(values), "batch": batch_std, "none": None}[scale_rewards]
        for s, r in zip(sessions, values, strict=True):
            if estimator == "leave_one_out":
                advantage[s] = r - (total - r) / (n - 1)
            else:
                advantage[s] = (r - total / n) / (scale + STD_EPS) if scale is not None else r - total / n
    sizes = Counter(len(v) for v in members.values())
    return GroupAdvantages(
        reward=reward,
        advantage=advantage,
        group_of=group_of,
        zero_variance_groups=zero_variance,
        singleton_groups=singleton,
        unrewarded_sessions=len(group_of) - len(reward),
        mixed_reward_sessions=mixed,
        group_sizes=dict(sorted(sizes.items())),
    )


def sample_std(values: Sequence[float]) -> float:
    """Sample standard deviation (Bessel-corrected, like TRL's `nanstd`); 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
