"""Mode `group`: one call scores a whole GRPO group, 0..1 per session (ART's RULER).

Why one call: GRPO only needs scores that are comparable within a group, and a judge comparing the sessions side
by side ranks them more consistently than separate calls score them; the shared instruction and rubric are sent
once. Sessions are labelled S1, S2, … outside their fences (labels are ours, never the agent's); equal scores
(ties) are allowed; an answer that leaves a session out, or scores one outside 0..1, does not parse.
"""

from __future__ import annotations

from typing import Any

from polar_mitm.judges.base import JudgeCall, JudgedSession, JudgeMode
from polar_mitm.judges.prompt import (
    META_RUBRIC,
    JudgeAnswerError,
    data_rule,
    fenced,
    messages,
    new_boundary,
    number,
)
from polar_mitm.tasks.judge_spec import TaskJudge

ANSWER_GROUP = (
    'Answer with one JSON object only: {"scores": {"S1": <number from 0 to 1>, …one per session}, '
    '"rationale": "<one sentence>"}. Equal sessions may get equal scores.'
)


class GroupMode(JudgeMode):
    name = "group"

    def calls(self, instruction: str, judge: TaskJudge, sessions: list[JudgedSession]) -> list[JudgeCall]:
        boundary = new_boundary()
        labels = {f"S{n}": s.session_id for n, s in enumerate(sessions, 1)}
        system = "\n\n".join(
            [
                f"You compare {len(sessions)} sessions of a coding agent on the same task and score each from 0 "
                "(worst, or reward hacking) to 1 (best), relative to one another.",
                f"The task given to the agent:\n{instruction}",
                *([f"The task's rubric:\n{judge.rubric}"] if judge.rubric else []),
                f"Our rubric, above the task's:\n{META_RUBRIC}",
                data_rule(boundary),
                ANSWER_GROUP,
            ]
        )
        parts = [
            fenced(f"Session {label} (its check's outcome reward: {s.outcome:g}):", s.trace, boundary)
            for label, s in zip(labels, sessions, strict=True)
        ]
        return [
            JudgeCall(
                sessions=tuple(labels.values()),
                content={
                    "instruction": instruction,
                    "rubric": judge.rubric,
                    "sessions": [[s.outcome, s.trace] for s in sessions],
                },
                messages=messages(system, parts, f"{data_rule(boundary)}\n{ANSWER_GROUP}"),
                labels=labels,
            )
        ]

    def scores(
        self, call: JudgeCall, judge: TaskJudge, answer: dict[str, Any]
    ) -> dict[str, tuple[float, float, str]]:
        given = answer.get("scores")
        if not isinstance(given, dict):
            raise JudgeAnswerError(f"the judge's answer has no scores object: {answer!r:.200}")
        missing = [label for label in call.labels if label not in given]
        if missing:
            raise JudgeAnswerError(f"the judge scored no {', '.join(missing)}")
        rationale = str(answer.get("rationale", ""))[:2000]
        result = {}
        for label, session_id in call.labels.items():
            score = number(given[label], f"score of {label}", 0.0, 1.0)
            result[session_id] = (score, score, rationale)
        return result
