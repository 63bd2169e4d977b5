"""The rollout's live view: sessions by stage, throughput, reward so far (Rich)."""

from __future__ import annotations

import time
from collections import Counter

from rich.table import Table

from polar_mitm.log_format import EventLog
from polar_mitm.rollout.runner import SessionRun
from polar_mitm.storage.session_ends import end_counts, ends_line
from polar_mitm.terminal import plain, printable

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
    """Per task: sessions, outcomes, reward mean, and how the sessions that did not complete ended (once the records
    have said: `settle_ends`)."""
    table = Table(title="rewards by task")
    for col in ("task", "sessions", "ok", "failed", "timeout/crashed", "cut", "reward mean", "ends"):
        table.add_column(col, justify="left" if col in ("task", "ends") else "right")
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
            ends_line(end_counts([s.end for s in group])),
        )
    return table


class SessionEvents:
    """The rollout as events (`--log-format lines|json`, or any output that is not a terminal): one when it starts
    and one per finished session, with its outcome and reward."""

    def __init__(self, log: EventLog, total: int) -> None:
        self.log, self.total = log, total
        self.reported: set[str] = set()
        log.event("rollout", f"rollout: {total} sessions", sessions=total)

    def update(self, sessions: list[SessionRun]) -> None:
        for s in sessions:
            if s.stage != "done" or s.session_id in self.reported:
                continue
            self.reported.add(s.session_id)
            spans = list(s.spans.values())
            seconds = round(max(e for _, e in spans) - min(b for b, _ in spans), 1) if spans else None
            reward = "–" if s.reward is None else f"{s.reward:.3f}"
            self.log.event(
                "session",
                f"{len(self.reported)}/{self.total} {plain(s.session_id)} {s.status} reward {reward}"
                + (f" ({seconds:.1f}s)" if seconds is not None else "")
                + why_it_broke(s),
                session_id=s.session_id,
                task_id=s.task.task_id,
                status=s.status,
                reward=s.reward,
                seconds=seconds,
                done=len(self.reported),
                total=self.total,
            )


# Their eval_output is our own reason, not a grader's output.
BROKEN_STATUSES = ("crashed", "init_failed", "error")


def why_it_broke(session: SessionRun, width: int = 160) -> str:
    """`: REASON` (its first line, cut to `width`) for a session that broke before it could be graded, else ''."""
    if session.status not in BROKEN_STATUSES or not session.eval_output.strip():
        return ""
    reason = session.eval_output.strip().splitlines()[0]
    return ": " + printable(reason if len(reason) <= width else reason[: width - 1] + "…")


def summary_rows(sessions: list[SessionRun]) -> list[dict]:
    """`summary_table`'s rows as data (the json log's last event)."""
    by_task: dict[str, list[SessionRun]] = {}
    for s in sessions:
        by_task.setdefault(s.task.task_id, []).append(s)
    rows = []
    for task_id, group in by_task.items():
        rewards = [s.reward for s in group if s.reward is not None]
        rows.append(
            {
                "task_id": task_id,
                "sessions": len(group),
                "statuses": dict(Counter(s.status for s in group)),
                "ends": end_counts([s.end for s in group]),
                "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            }
        )
    return rows
