"""The check of an answer task: grades what the harness finally said against the expected answer.

A task file's `eval.command` runs this file (a copy beside the task file, stdlib only, so any `python3` runs it)
with the expected answer; it reads the harness's output from `$POLAR_HARNESS_OUTPUT` (the session's log, which the
rollout names for every evaluation) and prints the reward (`eval.reward: "stdout"`):

- 1.0 the reply is the answer and nothing else (surrounding space, quotes, backticks, bold and a final period
  allowed): `7`, `"7".`, `**7**`;
- 0.5 a reply whose first line is short (at most SHORT_WORDS words) and ends in the answer: `3 + 4 equals 7.`,
  with anything after it — partial credit, so that a small model that answers right but wordily gives GRPO a
  difference to learn from (the full 1.0 needs it to stop there); listing candidates does not earn it, since only
  the first line's last number or word counts;
- 0.0 otherwise, and when there is no output at all.

Only 1.0 is a pass (`polar_mitm.rollout.tasks.passed`).
"""

from __future__ import annotations

import os
import re
import sys

OUTPUT_ENV = "POLAR_HARNESS_OUTPUT"
SHORT_WORDS = 8
WRAPPING = " \t\r\n\"'`*"


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
    first = next((line for line in reply.splitlines() if line.strip()), "")
    tokens = re.findall(r"[a-z]+|-?\d+", first.lower())
    if 0 < len(first.split()) <= SHORT_WORDS and tokens and tokens[-1] == answer:
        return 0.5
    return 0.0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: answer_check.py EXPECTED (the harness output in $POLAR_HARNESS_OUTPUT)", file=sys.stderr
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
