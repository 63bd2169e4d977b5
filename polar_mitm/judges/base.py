"""The interface every judge mode implements (one module per mode, picked by the registry in __init__.py).

A mode turns a task's group of finished sessions into judge calls (`calls`) and one call's parsed answer into a
normalised score per session (`scores`); the judging itself (the client, the cache, the files, the rewards) is
judging.py's and the same for every mode, so a mode is only its prompt and its answer's shape.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from polar_mitm.tasks.judge_spec import TaskJudge


@dataclass(frozen=True)
class JudgedSession:
    """A finished session as a judge mode sees it."""

    session_id: str
    index: int
    outcome: float  # the check's reward
    trace: str  # session_trace: already within the budget


@dataclass(frozen=True)
class JudgeCall:
    """One request to the judge and the sessions its answer scores."""

    sessions: tuple[str, ...]  # session ids
    content: dict[str, Any]  # what is judged, boundary-free: the cache key is its hash
    messages: list[dict[str, str]]  # the prompt, fenced with this call's boundary
    labels: dict[str, str]  # label in the prompt → session id (group mode's S1, S2, …)


class JudgeMode(ABC):
    name: ClassVar[str]

    @abstractmethod
    def calls(self, instruction: str, judge: TaskJudge, sessions: list[JudgedSession]) -> list[JudgeCall]:
        """The judge calls for one task's sessions (a group, or what is left of it)."""

    @abstractmethod
    def scores(
        self, call: JudgeCall, judge: TaskJudge, answer: dict[str, Any]
    ) -> dict[str, tuple[float, float, str]]:
        """Per session id: (normalised score, the judge's raw score, rationale); JudgeAnswerError if it does not
        parse into that."""
