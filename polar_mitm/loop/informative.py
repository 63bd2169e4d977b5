"""Informative groups (dynamic sampling at rollout, as DAPO, verl, AReaL and slime do it) for `polar-mitm loop
--min-informative-groups N`.

A GRPO group whose sessions all earned the same reward (all pass, all fail) has zero advantage: it costs a
rollout and teaches nothing. With the option on, an iteration starts with N task groups, taken from one seeded cycle
through the task file (every task comes round once every ⌈T/N⌉ iterations). When they are done, every group whose
rewards are all equal is counted as uninformative and, within `--resample-budget M` extra groups per iteration,
groups of tasks this iteration has not run yet (in an order shuffled per iteration) are rolled out through the same
gateway (new session ids, records in the same `iter-K/flows`, rewards written with the others), wave after wave,
until N groups are informative, the budget is spent or no task is left. A task never runs twice in one iteration:
the trainer groups sessions by task id, so a second group of the same task would be averaged into the first.

The flat groups keep their records and rewards (the reward curve and the report count them) but are not trained
on: the trainer's batch plan leaves zero-advantage groups out (train/batching.py), and the option refuses
`--keep-zero-advantage-groups`. "All equal" is the trainer's own test (train/advantages.py): fewer than two rewarded
sessions, or rewards within `ZERO_VARIANCE_TOL` of each other. Sessions cut by `--keep` have no reward and do not
count.

Pure functions decide (which groups are flat, the iteration's task order, the next wave); `GroupSampler` keeps one
iteration's draw and `sample_groups` runs the waves through the loop's rollout callable. With `--ray` the option is
refused (one line at start): the Ray pool runs one fixed task list per rollout.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from polar_mitm.rollout.runner import RolloutSummary, SessionRun
from polar_mitm.tasks.task_file import Task
from polar_mitm.train.advantages import ZERO_VARIANCE_TOL

if TYPE_CHECKING:
    from polar_mitm.loop.config import LoopConfig


def group_rewards(sessions: Sequence[SessionRun]) -> dict[str, list[float]]:
    """Each task's group (in the order the groups first appear) and the rewards of its rewarded sessions."""
    groups: dict[str, list[float]] = {}
    for session in sessions:
        rewards = groups.setdefault(session.task.task_id, [])
        if session.reward is not None:
            rewards.append(session.reward)
    return groups


def is_informative(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards give GRPO a nonzero advantage: two or more rewards that are not all equal."""
    return len(rewards) >= 2 and max(rewards) - min(rewards) > ZERO_VARIANCE_TOL


def uninformative_tasks(sessions: Sequence[SessionRun]) -> list[str]:
    """The tasks whose groups have zero advantage (all rewards equal, or fewer than two rewards)."""
    return [task for task, rewards in group_rewards(sessions).items() if not is_informative(rewards)]


def iteration_order(task_count: int, per_iteration: int, iteration: int, seed: int) -> list[int]:
    """Iteration `iteration`'s task indices, all of them once: its first `per_iteration` are its initial groups, the
    rest the candidates for replacements, in order. The initial groups read one seeded permutation of the task file
    as a cycle that each iteration enters `per_iteration` further on, so they go round every task in turn; the
    candidates are the other tasks shuffled anew each iteration (taken in cycle order, they would be the next
    iteration's initial groups, run twice in a row)."""
    cycle = list(range(task_count))
    random.Random(f"polar-mitm task cycle {seed}").shuffle(cycle)
    start = (iteration * per_iteration) % task_count if task_count else 0
    rotated = cycle[start:] + cycle[:start]
    initial, candidates = rotated[:per_iteration], rotated[per_iteration:]
    random.Random(f"polar-mitm replacements {seed} {iteration}").shuffle(candidates)
    return initial + candidates


def next_wave_size(*, informative: int, wanted: int, budget_left: int, candidates_left: int) -> int:
    """How many replacement groups the next wave rolls out (0: the iteration's rollout is done)."""
    return max(0, min(wanted - informative, budget_left, candidates_left))


@dataclass
class GroupSampler:
    """One iteration's draw: `order` is its task order (initial groups first), `wanted` the informative groups it
    aims at, `budget` the replacement groups it may add."""

    order: list[Task]
    wanted: int
    budget: int
    drawn: int = 0  # tasks of `order` rolled out (or being rolled out) so far
    replaced: int = 0  # of them, replacement groups

    def first_wave(self) -> list[Task]:
        self.drawn = min(self.wanted, len(self.order))
        return self.order[: self.drawn]

    def next_wave(self, sessions: Sequence[SessionRun]) -> list[Task]:
        """The replacement groups to roll out after `sessions` (every session of the iteration so far)."""
        groups = group_rewards(sessions)
        size = next_wave_size(
            informative=sum(is_informative(rewards) for rewards in groups.values()),
            wanted=self.wanted,
            budget_left=self.budget - self.replaced,
            candidates_left=len(self.order) - self.drawn,
        )
        wave = self.order[self.drawn : self.drawn + size]
        self.drawn += size
        self.replaced += size
        return wave


@dataclass
class SampledRolloutSummary(RolloutSummary):
    """An iteration's rollout made of waves: every session of every wave, and how many groups were replacements."""

    replaced_groups: int = 0
    waves: int = 1
    wave_seconds: list[float] = field(default_factory=list)


def combined_summary(waves: Sequence[RolloutSummary], replaced_groups: int) -> SampledRolloutSummary:
    """The waves' summaries as one: their sessions, wall time summed, RUN utilisation weighted by wall time."""
    wall = sum(w.wall_seconds for w in waves)
    utilisation = sum(w.run_utilisation * w.wall_seconds for w in waves) / wall if wall > 0 else 0.0
    return SampledRolloutSummary(
        sessions=[s for w in waves for s in w.sessions],
        wall_seconds=wall,
        run_utilisation=utilisation,
        replaced_groups=replaced_groups,
        waves=len(waves),
        wave_seconds=[w.wall_seconds for w in waves],
    )


async def sample_groups(
    sampler: GroupSampler, run_wave: Callable[[list[Task]], Awaitable[RolloutSummary]]
) -> SampledRolloutSummary:
    """Roll out the sampler's first wave, then replacement waves while it draws any (one gateway for all)."""
    waves = [await run_wave(sampler.first_wave())]
    while wave := sampler.next_wave([s for w in waves for s in w.sessions]):
        waves.append(await run_wave(wave))
    return combined_summary(waves, sampler.replaced)


def group_sampler(cfg: LoopConfig, tasks: list[Task], iteration: int) -> GroupSampler | None:
    """Iteration `iteration`'s sampler, or None when `--min-informative-groups` is off (every task, one group)."""
    wanted = cfg.min_informative_groups
    if wanted is None:
        return None
    order = [tasks[i] for i in iteration_order(len(tasks), wanted, iteration, cfg.seed)]
    budget = wanted if cfg.resample_budget is None else cfg.resample_budget
    return GroupSampler(order=order, wanted=wanted, budget=budget)


def group_figures(summary: RolloutSummary) -> dict[str, int]:
    """IterationStats' group counts of a rollout: groups, those with zero advantage, and replacement groups (0 for
    a rollout without `--min-informative-groups`)."""
    groups = group_rewards(summary.sessions)
    return {
        "groups": len(groups),
        "uninformative_groups": sum(not is_informative(rewards) for rewards in groups.values()),
        "replaced_groups": summary.replaced_groups if isinstance(summary, SampledRolloutSummary) else 0,
    }


def dynamic_sampling_problem(cfg: LoopConfig) -> str | None:
    """Why the loop's dynamic-sampling options cannot be used as given (None: they can)."""
    wanted, budget = cfg.min_informative_groups, cfg.resample_budget
    if wanted is None:
        return "--resample-budget needs --min-informative-groups" if budget is not None else None
    if wanted < 1 or (budget is not None and budget < 0):
        return "--min-informative-groups must be at least 1 and --resample-budget at least 0"
    if cfg.ray_address is not None:
        return "--min-informative-groups is not supported with --ray (the Ray pool runs one fixed task list)"
    if cfg.group_size < 2:
        return "--min-informative-groups needs --group-size 2 or more (a group of one has zero advantage)"
    if cfg.grpo.get("keep_zero_advantage_groups"):
        return (
            "--min-informative-groups leaves flat groups out of training: drop --keep-zero-advantage-groups"
        )
    return None


def check_dynamic_sampling(cfg: LoopConfig) -> None:
    """Raise ValueError (one line) when the dynamic-sampling options cannot be used as given."""
    if (problem := dynamic_sampling_problem(cfg)) is not None:
        raise ValueError(problem)
