"""The check of an answer task: grades what the harness finally said against the expected answer.

A task file's `eval.command` runs this module from the installed package, `python -P -m
polar_mitm.tasks.answer_check EXPECTED` (never a copy in a folder an agent can write: one agent replaced such a
copy and every wrong answer, in that run and the later ones using the folder, got 1.0; `-P` keeps a `polar_mitm/`
in the workspace, the command's directory, off sys.path). It reads the harness's output from
`$POLAR_HARNESS_OUTPUT` (the session's log, which the rollout names for every evaluation) and prints the reward
(`eval.reward: "stdout"`):

- 1.0 the reply is the answer and nothing else (surrounding space, quotes, backticks, bold and a final period
  allowed): `7`, `"7".`, `**7**`;
- 0.5 a reply whose first line is short (at most SHORT_WORDS words) and gives the answer as its only number
  (numbers inside a sum such as `3 + 4` do not count): `3 + 4 equals 7.`, `7 is the answer`, with anything after
  it — partial credit, so that a small model that answers right but wordily gives GRPO a difference to learn from
  (the full 1.0 needs it to stop there);
- 0.0 otherwise: a wrong number, a negation (`It is not 7`), a hedge or a list of candidates (`7 or 8`, `7, 8`,
  `7-8`, `maybe 7`, `7?`, a later line that is another bare answer), and no output at all.

Only 1.0 is a pass (`polar_mitm.tasks.task_file.passed`).
"""

from __future__ import annotations

import os
import re
import sys

OUTPUT_ENV = "POLAR_HARNESS_OUTPUT"
SHORT_WORDS = 8
WRAPPING = " \t\r\n\"'`*"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# A sum, product, range or fraction of numbers (`3 + 4`, `7-8`, `11/12`): its numbers are not answers.
EXPRESSION = re.compile(r"-?\d+(?:\.\d+)?(?:\s*[-+*/×]\s*-?\d+(?:\.\d+)?)+")
WORD = re.compile(r"[a-z]+(?:'[a-z]+)?|-?\d+(?:\.\d+)?")
NEGATIONS = frozenset(
    {"not", "no", "never", "neither", "nor", "none", "cannot", "wrong", "incorrect", "false", "nope", "isnt"}
)
HEDGES = frozenset(
    {
        "or",
        "either",
        "maybe",
        "perhaps",
        "probably",
        "possibly",
        "might",
        "between",
        "about",
        "around",
        "approximately",
        "roughly",
        "nearly",
        "almost",
        "guess",
        "unsure",
    }
)


def normalise(text: str) -> str:
    """The reply without surrounding space, quotes, backticks, bold or a final period; lower case."""
    reply = text.strip(WRAPPING)
    reply = reply[:-1] if reply.endswith(".") else reply
    return reply.strip(WRAPPING).lower()


def grade(reply: str, expected: str) -> float:
    """The reward of `reply` for the expected answer (see the module docstring)."""
    answer = expected.strip().lower()
    if normalise(reply) == answer:
        return 1.0
    lines = [line for line in reply.splitlines() if line.strip()]
    first = lines[0].lower() if lines else ""
    if not 0 < len(first.split()) <= SHORT_WORDS or _hedged(first):
        return 0.0
    if NUMBER.fullmatch(answer):
        gives_answer = NUMBER.findall(EXPRESSION.sub(" ", first)) == [answer]
    else:
        words = WORD.findall(first)
        gives_answer = bool(words) and words[-1] == answer
    other_answer = any(normalise(line) not in ("", answer) and _bare(normalise(line)) for line in lines[1:])
    return 0.5 if gives_answer and not other_answer else 0.0


def _hedged(line: str) -> bool:
    """A negation, a hedge or a question: the line does not commit to one answer."""
    words = set(WORD.findall(line))
    return "?" in line or bool(words & (NEGATIONS | HEDGES)) or any(w.endswith("n't") for w in words)


def _bare(line: str) -> bool:
    """A line that is one number or one word: another candidate answer."""
    return NUMBER.fullmatch(line) is not None or re.fullmatch(r"[a-z]+", line) is not None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            f"usage: python -m polar_mitm.tasks.answer_check EXPECTED (the harness output in ${OUTPUT_ENV})",
            file=sys.stderr,
        )
        return 2
    path = os.environ.get(OUTPUT_ENV)
    if not path or not os.path.exists(path):
        print(f"no harness output ({OUTPUT_ENV} unset or missing): reward 0")
        print(0.0)
        return 0
    with open(path, encoding="utf-8", errors="replace") as handle:
        reply = handle.read()
    print(grade(reply, argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
