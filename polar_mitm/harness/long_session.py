"""A scripted long session that drives any harness through its own compaction (tests/harness/test_long_sessions.py).

The script is a small state machine over the prompt text rather than over the turn index, because a compaction
replaces the history (and with it the count of assistant turns the engine would otherwise go by):

- phase A: `echo STEP-Ann && seq …` shell calls whose output is large, so the context grows until the harness
  compacts (its threshold configured low, or the engine's context small);
- every harness's compaction instruction (gateway/call_kind.py) is answered with a summary that says
  `PHASE-B-STARTS`;
- phase B: small `echo STEP-Bnn` calls, then a final answer. Phase B starts from the summary, so the session goes
  on after the compaction; it also follows the last A step, so a harness that never compacts still finishes
  (and the test that expects a compaction fails instead of hanging).

A reply matches when its marker occurs in the prompt; the first match wins, so replies are listed from the latest
state to the earliest.
"""

from __future__ import annotations

from typing import Any

from polar_mitm.gateway.call_kind import COMPACTION_MARKERS
from polar_mitm.harness.policy import GEMINI_ROUTER, SIDE_TEXT, shell_call

PHASE_B = "PHASE-B-STARTS"
SUMMARY = (
    f"<summary>\nThe user asked for a series of shell steps. The first steps ran and printed long number "
    f"lists. {PHASE_B}: go on with the short steps.\n</summary>"
)
FINAL = "Done: every step ran."


def a_marker(k: int) -> str:
    return f"STEP-A{k:02d}"


def b_marker(k: int) -> str:
    return f"STEP-B{k:02d}"


def long_session_script(
    *, a_steps: int = 10, b_steps: int = 5, a_lines: int = 300, a_final: str | None = None
) -> dict[str, Any]:
    """The script (engine/script.py format). Each A step prints `a_lines` numbers of six digits (~7 tokens a
    line with Qwen's tokenizer, which splits digits).

    `a_final`: the text that ends the first prompt after the last A step (for a harness that compacts only
    between prompts: a second prompt then compacts and goes on with phase B); `b_steps = 0`: the answer after
    the summary is the final one.
    """

    def call(command: str) -> dict[str, Any]:
        return {"text": f"Running `{command}`.", "tool_call": shell_call(command)}

    a_commands = [f"echo {a_marker(k)} && seq 100000 {100000 + a_lines - 1}" for k in range(1, a_steps + 1)]
    b_commands = [f"echo {b_marker(k)}" for k in range(1, b_steps + 1)]
    b_start: dict[str, Any] = call(b_commands[0]) if b_commands else {"text": FINAL}
    # Gemini's routing classifier first: its prompt may quote the history, and it must get its JSON.
    replies: list[dict[str, Any]] = [GEMINI_ROUTER]
    replies += [{"when": marker, "text": SUMMARY} for _, marker in COMPACTION_MARKERS]
    if b_steps:
        replies.append({"when": b_marker(b_steps), "text": FINAL})
        replies += [{"when": b_marker(k), **call(b_commands[k])} for k in range(b_steps - 1, 0, -1)]
    replies.append({"when": PHASE_B, **b_start})
    replies.append({"when": a_marker(a_steps), **({"text": a_final} if a_final else b_start)})
    replies += [{"when": a_marker(k), **call(a_commands[k])} for k in range(a_steps - 1, 0, -1)]
    return {"turns": [call(a_commands[0])], "side": SIDE_TEXT, "replies": replies}
