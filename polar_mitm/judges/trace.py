"""What a judge sees of a session: its tool calls and their outputs, its final answer, the harness's own output and
the check's, cut to a character budget.

Why from the records: they hold exactly what the model was asked and answered (the last call's conversation carries
every earlier tool call and result; its answer is the final one), whatever the harness. The harness log adds what
the agent printed (a diff, a summary); the workspace itself is gone by now (removed at teardown). A trace longer
than the budget keeps its beginning (the approach) and its end (the result) and says how much of the middle is left
out, so the judge never mistakes an elided trace for a short one.
"""

from __future__ import annotations

import json
from typing import Any


def elided(text: str, budget: int) -> str:
    """`text` within `budget` characters: head and tail kept, the middle replaced by a line saying what is gone."""
    if len(text) <= budget:
        return text
    keep = max(budget - 80, 0)
    head, tail = text[: keep // 2], text[len(text) - (keep - keep // 2) :]
    return f"{head}\n[… {len(text) - len(head) - len(tail)} characters of the trace elided here …]\n{tail}"


def _message_lines(message: dict[str, Any]) -> list[str]:
    role = message.get("role", "?")
    lines = [f"[{role}] {message['content']}"] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        lines.append(f"[{role} → tool call {call.get('name')}] {call.get('arguments')}")
    if role == "tool" and not message.get("content"):
        lines.append("[tool] (no output)")
    return lines


def final_answer(response_json: str | None) -> str:
    """The text and tool calls of a provider-native answer (Chat Completions, Anthropic Messages, Responses)."""
    if not response_json:
        return ""
    try:
        answer = json.loads(response_json)
    except ValueError:
        return response_json
    if not isinstance(answer, dict):
        return response_json
    parts: list[str] = []
    for choice in answer.get("choices") or []:  # Chat Completions
        message = choice.get("message") or {}
        parts += [message["content"]] if message.get("content") else []
        parts += [
            f"tool call {c['function']['name']}: {c['function']['arguments']}"
            for c in message.get("tool_calls") or []
        ]
    for block in answer.get("content") or [] if isinstance(answer.get("content"), list) else []:  # Anthropic
        parts += [block["text"]] if block.get("type") == "text" else []
        parts += (
            [f"tool call {block.get('name')}: {json.dumps(block.get('input'))}"]
            if block.get("type") == "tool_use"
            else []
        )
    for item in answer.get("output") or []:  # Responses
        for content in item.get("content") or []:
            parts += [content["text"]] if content.get("text") else []
        parts += (
            [f"tool call {item.get('name')}: {item.get('arguments')}"]
            if item.get("type") == "function_call"
            else []
        )
    return "\n".join(parts) if parts else response_json


def session_trace(records: list[dict[str, Any]], harness_log: str, check_output: str, budget: int) -> str:
    """The session as the judge reads it, at most `budget` characters."""
    calls = sorted(records, key=lambda r: r["seq"])
    main = [r for r in calls if r.get("call_kind") != "side"] or calls
    sections = []
    if main:
        last = main[-1]
        conversation = json.loads(last.get("messages_json") or "[]")
        shown = [m for m in conversation if m.get("role") != "system"]  # the harness's, not the agent's
        shown = (
            shown[1:] if shown and shown[0].get("role") == "user" else shown
        )  # the instruction, said apart
        steps = [line for message in shown for line in _message_lines(message)]
        sections.append("## Tool calls and outputs\n" + ("\n".join(steps) or "(none)"))
        sections.append("## Final answer\n" + (final_answer(last.get("response_json")) or "(empty)"))
    else:
        sections.append("## Model calls\n(none recorded)")
    if harness_log.strip():
        sections.append("## Harness output (its log)\n" + harness_log.strip())
    if check_output.strip():
        sections.append("## The check's output\n" + check_output.strip())
    return elided("\n\n".join(sections), budget)
