"""Held-out evaluation for `polar-mitm loop --eval-tasks`: the training reward says how the policy does on the tasks
it learns from; only tasks it never trains on say whether it generalises. This module holds the arithmetic (the
unbiased pass@k of the Codex paper, Chen et al. 2021) and the check that the two task sets are disjoint; the loop
runs the evaluation rollouts (their records under `RUN/eval-K/`, never merged) and stores `EvalResult`s.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from math import comb
from typing import Any

from polar_mitm.rollout.runner import RolloutSummary
from polar_mitm.tasks.task_file import Task, passed


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k from `samples` attempts of which `correct` passed: 1 - C(n-c, k) / C(n, k) (exact integers,
    so no overflow or cancellation for any n)."""
    if not 0 <= correct <= samples or not 1 <= k <= samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= c <= n (n={samples}, c={correct})")
    return 1.0 - comb(samples - correct, k) / comb(samples, k)


def reported_ks(samples: int) -> list[int]:
    """The k of pass@k reported for N samples per task: 1, the powers of two below N, and N."""
    return sorted({1, samples, *(2**p for p in range(samples.bit_length()) if 2**p <= samples)})


@dataclass
class EvalResult:
    """One held-out evaluation: the weights it measured, pass@k averaged over tasks, and each task's counts."""

    iteration: int  # evaluated after this iteration's training
    weight_version: str | None
    sessions: int
    reward_mean: float
    pass_at: dict[str, float]  # "pass@1", "pass@N", … : the mean over tasks of each task's unbiased estimate
    per_task: dict[str, dict[str, int]] = field(default_factory=dict)  # task_id → {"samples": n, "passed": c}
    greedy: bool = False
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def task_counts(summary: RolloutSummary) -> dict[str, dict[str, int]]:
    """Per task, the rewarded sessions and those that passed (`tasks.passed`, as the loop's pass rate counts them)."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"samples": 0, "passed": 0})
    for session in summary.sessions:
        if session.reward is None:  # cut or unevaluated: not an attempt
            continue
        counts[session.task.task_id]["samples"] += 1
        counts[session.task.task_id]["passed"] += passed(session.reward)
    return dict(counts)


def pass_at_ks(per_task: dict[str, dict[str, int]], ks: list[int]) -> dict[str, float]:
    """pass@k for each k, the mean over the tasks that have at least k attempts."""
    scores: dict[str, float] = {}
    for k in ks:
        estimates = [pass_at_k(c["samples"], c["passed"], k) for c in per_task.values() if c["samples"] >= k]
        if estimates:
            scores[f"pass@{k}"] = sum(estimates) / len(estimates)
    return scores


def evaluation_result(
    summary: RolloutSummary, *, iteration: int, weight_version: str | None, samples: int, greedy: bool
) -> EvalResult:
    """The EvalResult of an evaluation rollout of `samples` sessions per held-out task."""
    rewards = [s.reward for s in summary.sessions if s.reward is not None]
    per_task = task_counts(summary)
    return EvalResult(
        iteration=iteration,
        weight_version=weight_version,
        sessions=len(summary.sessions),
        reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
        pass_at=pass_at_ks(per_task, reported_ks(samples)),
        per_task=per_task,
        greedy=greedy,
        seconds=summary.wall_seconds,
    )


def check_held_out(train_tasks: list[Task], eval_tasks: list[Task]) -> None:
    """Refuse an eval set that shares a task id with the training set: it would not be held out."""
    shared = sorted({t.task_id for t in train_tasks} & {t.task_id for t in eval_tasks})
    if shared:
        raise ValueError(f"--eval-tasks shares task ids with the training tasks: {', '.join(shared)}")
    if not eval_tasks:
        raise ValueError("--eval-tasks holds no task")


def eval_due(iteration: int, every: int, iterations: int) -> bool:
    """Evaluate after every `every`-th training, and always after the last one."""
    return (iteration + 1) % every == 0 or iteration + 1 == iterations
