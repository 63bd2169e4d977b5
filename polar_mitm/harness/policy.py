"""A scripted policy that drives any of the six harnesses (`polar-mitm serve --script`, see engine/script.py).

Each scripted tool call lists every harness's shell tool name with that harness's argument shape; the engine
picks the one the request offers. Side requests (no tools) get a short text, and Gemini CLI's routing classifier
(a JSON-mode side request) gets the JSON it asks for.
"""

from __future__ import annotations

from typing import Any

from polar_mitm.harness import HARNESSES
from polar_mitm.harness.aider import WHOLE_FORMAT_MARKER
from polar_mitm.harness.mini_swe_agent import SUBMIT_COMMAND

THINKING = "The user wants this done with one shell command; then I will check the result."
GEMINI_ROUTER = {
    "when": "Complexity Score",
    "text": '{"complexity_reasoning": "A single shell command.", "complexity_score": 10}',
}
# Claude Code's compaction turn (`/compact`) asks for a text-only summary of the conversation so far.
CLAUDE_COMPACT = {
    "when": "CRITICAL: Respond with TEXT ONLY",
    "text": "<summary>\nThe user asked for hello in out.txt; it was written and checked.\n</summary>",
}
SIDE_TEXT = "Write hello into out.txt"  # what title/summary side requests get: short and harmless
# Aider has no tools: the model writes the file out in its whole-file edit format, and Aider applies it.
AIDER_EDIT = {"when": WHOLE_FORMAT_MARKER, "text": "Creating out.txt.\n\nout.txt\n```\nhello\n```"}


def shell_call(command: str) -> dict[str, Any]:
    """One adaptive tool call: the first shell tool (over all harnesses) the request offers runs `command`.

    Harnesses that share a tool name (Pi's and opencode's `bash`) get the union of their argument shapes: each
    accepts the other's optional fields.
    """
    shapes: dict[str, dict[str, Any]] = {}
    for harness in HARNESSES.values():
        for tool in harness.shell_tools:
            shapes[tool.name] = {**shapes.get(tool.name, {}), **tool.call(command)}
    return {"name": list(shapes), "arguments": {"command": command}, "arguments_by_name": shapes}


def shell_script(commands: list[str], final: str, *, think: bool = True) -> dict[str, Any]:
    """Turn k (k < len(commands)) runs commands[k]; then `final`. The first turn thinks first (reasoning round
    trips: thinking blocks, Responses reasoning items, Gemini thoughts). mini-swe-agent ends only by running its
    submit command (a text-only turn gets a format error), so its prompts — the only ones naming that command —
    get `final` with the submit call at the last turn."""
    turns: list[Any] = []
    for k, command in enumerate(commands):
        text = f"<think>\n{THINKING}\n</think>\n\n" if think and k == 0 else ""
        turns.append({"text": text + f"Running `{command}`.", "tool_call": shell_call(command)})
    turns.append(final)
    submit = {
        "when": SUBMIT_COMMAND.removeprefix("echo "),
        "turn": len(commands),
        "text": final,
        "tool_call": shell_call(SUBMIT_COMMAND),
    }
    return {"turns": turns, "side": SIDE_TEXT, "replies": [GEMINI_ROUTER, CLAUDE_COMPACT, submit, AIDER_EDIT]}


HELLO_SCRIPT = shell_script(["echo hello > out.txt"], "Done: out.txt now says hello.")
