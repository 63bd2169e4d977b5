"""A task's `judge` (task file): an LLM judge that rewards a session beyond its check, and on what terms.

    "judge": {"mode": "rubric", "rubric": "The fix comes with a test.", "weight": 0.2, "scale": [-5, 5]}
    "judge": {"mode": "group", "rubric": "Prefer the smallest correct change."}   # one call ranks the group, 0..1
    "judge": {"mode": "reference", "reference": "42"}                             # yes/no against the answer

The shape lives here, beside the rest of the task line, so that the task file knows what it may say without
knowing how judges run (polar_mitm/judges/ runs them, after a rollout's sessions). Every mode combines the same way:
`reward = outcome + weight · normalised score` (rubric: score / max of its scale; group: 0..1; reference: 1 or 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, StringConstraints, model_validator

JUDGE_MODES = ("rubric", "group", "reference")
DEFAULT_WEIGHT = 0.2  # Polar's: a judge nudges the outcome, it does not replace it
DEFAULT_SCALE = (-5, 5)  # Polar's rubric scale

JudgeText = Annotated[StrictStr, StringConstraints(min_length=1)]


@dataclass(frozen=True)
class TaskJudge:
    """A task's judge, checked (JudgeSpec); polar_mitm/judges/ runs it."""

    mode: str
    rubric: str | None = None
    reference: str | None = None
    weight: float = DEFAULT_WEIGHT
    scale: tuple[int, int] = DEFAULT_SCALE


class JudgeSpec(BaseModel):
    """The task line's `judge`: unknown fields refused, every value checked before anything runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["rubric", "group", "reference"]
    rubric: JudgeText | None = None  # what a good session does, in the task author's words
    reference: JudgeText | None = None  # mode reference: the answer the session's must agree with
    weight: Annotated[float, Field(ge=0, allow_inf_nan=False)] = DEFAULT_WEIGHT
    scale: tuple[StrictInt, StrictInt] = DEFAULT_SCALE  # mode rubric: [min, max], max > 0

    @model_validator(mode="after")
    def _fits_its_mode(self) -> JudgeSpec:
        if self.mode == "rubric" and self.rubric is None:
            raise ValueError("judge.rubric is missing: mode rubric scores the session against it")
        if self.mode == "reference" and self.reference is None:
            raise ValueError("judge.reference is missing: mode reference compares the answer with it")
        if self.mode != "reference" and self.reference is not None:
            raise ValueError(f"judge.reference is for mode reference, not {self.mode}")
        if "scale" in self.model_fields_set and self.mode != "rubric":
            raise ValueError(f"judge.scale is for mode rubric, not {self.mode}")
        low, high = self.scale
        if not low < high or high <= 0:
            raise ValueError(
                f"judge.scale must be [min, max] with min < max and max > 0, not {list(self.scale)}"
            )
        return self

    def judge(self) -> TaskJudge:
        return TaskJudge(self.mode, self.rubric, self.reference, float(self.weight), self.scale)
