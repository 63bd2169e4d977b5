"""The rollout service's judge: tasks of evaluator strategy `rubric` (a task line's `judge`) judged as their sessions
finish, before their results are reported, so a trace's `reward` is already `outcome + weight · score`.

The judging is polar_mitm/judges/'s, the one `polar-mitm rollout` and the loop run (judging.py: the modes, the
trace, the cache, the failure rule); this only says when and where. Modes `rubric` and `reference` judge each
session as it finishes; mode `group` holds a task's finished sessions until none of its sessions is left to finish
(jobs.py), then judges them in one call. What the judge said is kept per task (OUT/tasks/<task>/judgments/), the
cache is the service's (OUT/judge-cache) and the judge options are `serve-rollouts`' own (JudgeOptions). A failed
call follows `--judge-failure`: `outcome` keeps the check's reward (counted in the task's judgments/summary.json
and the trajectory's metadata), `fail` makes the session an ERROR that names the judge's failure.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from polar_mitm.judges.judging import JudgeCounts, JudgeFailed, JudgePlaces, judge_problem, judge_sessions
from polar_mitm.judges.options import JudgeOptions
from polar_mitm.rollout.runner import SessionRun
from polar_mitm.service.task_requests import RequestError
from polar_mitm.storage import judgments as stored
from polar_mitm.storage import service_layout as layout
from polar_mitm.tasks.task_file import Task


@dataclass(frozen=True)
class Verdict:
    """What judging made of a session: the reward its traces carry, and what its result says of the judge."""

    reward: float | None
    judge: dict[
        str, Any
    ]  # the judgment as kept (mode, status, outcome, score, …), for the trajectory's metadata
    error: str | None = None  # `--judge-failure fail` and the judge failed: the session is an ERROR


class ServiceJudge:
    """Judges the service's finished sessions with `options` (one lock per task: its summary is counted whole)."""

    def __init__(self, options: JudgeOptions, out: Path, flows: Path, harness_logs: Path) -> None:
        self.options, self.out, self.flows, self.harness_logs = options, out, flows, harness_logs
        self._counts: dict[Path, JudgeCounts] = {}

    def check(self, task: Task) -> None:
        """A RequestError when this service cannot judge `task` (no `--judge-url`), before it is accepted."""
        if task.judge is not None and (problem := judge_problem([task], self.options)) is not None:
            raise RequestError(f"evaluator.strategy rubric: {problem} when starting serve-rollouts")

    @staticmethod
    def holds_group(task: Task) -> bool:
        """Whether `task`'s sessions wait for one another: mode `group` ranks the whole group in one call."""
        return task.judge is not None and task.judge.mode == "group"

    async def judge(self, folder: Path, sessions: Sequence[SessionRun]) -> dict[str, Verdict]:
        """Each judged session's verdict, by session id (those its task does not judge, or whose check gave no
        reward, are left out: their result is as it was)."""
        judged = [s for s in sessions if s.task.judge is not None and s.reward is not None]
        if not judged:
            return {}
        outcomes = {s.session_id: s.reward for s in judged}
        places = JudgePlaces(
            records=self.flows,
            judgments=layout.judgments_dir(folder),
            cache=self.out / layout.JUDGE_CACHE_DIR,
            harness_logs=self.harness_logs,
            records_per_session=True,
        )
        failure = None
        try:
            counts = await asyncio.to_thread(judge_sessions, judged, self.options, places)
        except JudgeFailed as exc:
            failure, counts = f"the judge failed (--judge-failure fail): {exc}", None
        self._count(places.judgments, counts, len(judged) if failure else 0)
        verdicts = {}
        for s in judged:
            kept = _judgment(places.judgments, s.session_id)
            if failure is not None and (kept is None or kept.get("status") == "failed"):
                s.reward = outcomes[s.session_id]
                verdicts[s.session_id] = Verdict(None, kept or {}, failure)
            else:
                verdicts[s.session_id] = Verdict(s.reward, kept or {})
        return verdicts

    def _count(self, judgments: Path, counts: JudgeCounts | None, failed: int) -> None:
        """The task's summary.json: every judging of its sessions added up (judge_sessions writes one call's)."""
        total = self._counts.setdefault(judgments, JudgeCounts())
        if counts is None:
            total.failed += failed
        else:
            for name, value in asdict(counts).items():
                setattr(total, name, getattr(total, name) + value)
        stored.write_summary(judgments, asdict(total) | {"failure": self.options.judge_failure.value})


def _judgment(judgments: Path, session_id: str) -> dict[str, Any] | None:
    path = judgments / f"{session_id}.json"
    return json.loads(path.read_text()) if path.is_file() else None
