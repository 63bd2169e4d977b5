"""The rollout's live view: sessions by stage, throughput, reward so far (Rich)."""

from __future__ import annotations

import time
from collections import Counter

from rich.table import Table

from polar_mitm.rollout.runner import SessionRun
from polar_mitm.terminal import plain

STAGES = ("pending", "init", "ready", "run", "post", "done")


def render(sessions: list[SessionRun], started: float) -> Table:
    stages = Counter(s.stage for s in sessions)
    statuses = Counter(s.status for s in sessions if s.stage == "done")
    rewards = [s.reward for s in sessions if s.reward is not None]
    elapsed = max(time.monotonic() - started, 1e-6)
    table = Table(title="polar-mitm rollout", expand=False)
    for stage in STAGES:
        table.add_column(stage, justify="right")
    table.add_column("sessions/min", justify="right")
    table.add_column("reward", justify="right")
    table.add_column("outcomes")
    mean = f"{sum(rewards) / len(rewards):.3f} (n={len(rewards)})" if rewards else "–"
    table.add_row(
        *(str(stages.get(stage, 0)) for stage in STAGES),
        f"{stages.get('done', 0) / elapsed * 60:.1f}",
        mean,
        plain(" ".join(f"{k}:{v}" for k, v in sorted(statuses.items()))),
    )
    return table


def summary_table(sessions: list[SessionRun]) -> Table:
    """Per task: sessions, outcomes, reward mean."""
    table = Table(title="rewards by task")
    for col in ("task", "sessions", "ok", "failed", "timeout/crashed", "cut", "reward mean"):
        table.add_column(col, justify="right" if col != "task" else "left")
    by_task: dict[str, list[SessionRun]] = {}
    for s in sessions:
        by_task.setdefault(s.task.task_id, []).append(s)
    for task_id, group in by_task.items():
        c = Counter(s.status for s in group)
        rewards = [s.reward for s in group if s.reward is not None]
        table.add_row(
            plain(task_id),
            str(len(group)),
            str(c["ok"]),
            str(c["failed"]),
            str(c["timeout"] + c["crashed"] + c["init_failed"] + c["error"]),
            str(c["cut"]),
            f"{sum(rewards) / len(rewards):.3f}" if rewards else "–",
        )
    return table
