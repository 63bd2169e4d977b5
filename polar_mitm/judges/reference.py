"""Mode `reference`: yes or no, does the session's answer agree with the task's reference answer (verifiers'
JudgeRubric). One call per session; yes scores 1, no scores 0."""

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
)
from polar_mitm.tasks.judge_spec import TaskJudge

ANSWER_REFERENCE = (
    'Answer with one JSON object only: {"verdict": "yes" | "no", "rationale": "<one sentence>"}.'
)


class ReferenceMode(JudgeMode):
    name = "reference"

    def calls(self, instruction: str, judge: TaskJudge, sessions: list[JudgedSession]) -> list[JudgeCall]:
        return [self._call(instruction, judge, session) for session in sessions]

    def _call(self, instruction: str, judge: TaskJudge, session: JudgedSession) -> JudgeCall:
        boundary = new_boundary()
        system = "\n\n".join(
            [
                "You decide whether a coding agent's answer agrees with the reference answer: yes or no.",
                f"The task given to the agent:\n{instruction}",
                f"The reference answer:\n{judge.reference}",
                f"Say no, whatever the answer, if: {META_RUBRIC}",
                data_rule(boundary),
                ANSWER_REFERENCE,
            ]
        )
        return JudgeCall(
            sessions=(session.session_id,),
            content={"instruction": instruction, "reference": judge.reference, "trace": session.trace},
            messages=messages(
                system,
                [fenced("The session's trace:", session.trace, boundary)],
                f"{data_rule(boundary)}\n{ANSWER_REFERENCE}",
            ),
            labels={},
        )

    def scores(
        self, call: JudgeCall, judge: TaskJudge, answer: dict[str, Any]
    ) -> dict[str, tuple[float, float, str]]:
        verdict = str(answer.get("verdict", "")).strip().lower()
        if verdict not in ("yes", "no"):
            raise JudgeAnswerError(f"the judge's verdict is neither yes nor no: {answer.get('verdict')!r}")
        score = 1.0 if verdict == "yes" else 0.0
        return {call.sessions[0]: (score, score, str(answer.get("rationale", ""))[:2000])}
