"""Scripted policy for tests: the engine "writes" scripted assistant turns instead of sampling.

A random tiny model never calls tools, yet harness tests need a tool call and then a final answer. With a script,
turn k of a conversation (k = assistant turns already in the prompt) is the k-th scripted text, tokenised by the
real tokenizer and followed by the end-of-turn token. Its logprobs are still the true log-probabilities of those
tokens under the model (the engine scores them during decoding), so records stay honest and the gateway cannot
tell a scripted turn from a sampled one.

Script file: JSON (or YAML-free JSONL) — a list whose items are either a string (raw assistant text, e.g.
`<tool_call>\n{"name": "shell", "arguments": {...}}\n</tool_call>`) or {"tool_call": {"name": ..., "arguments": {...}}}
or {"text": ...}. After the last item the script repeats its last turn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IM_START, ASSISTANT_TOKEN_TEXT = "<|im_start|>", "assistant"


def turn_text(item: Any) -> str:
    """The raw assistant text of one script item."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and "tool_call" in item:
        calls = item["tool_call"] if isinstance(item["tool_call"], list) else [item["tool_call"]]
        prefix = item.get("text", "")
        blocks = [
            "<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c.get("arguments", {})}, ensure_ascii=False)
            + "\n</tool_call>"
            for c in calls
        ]
        return (prefix + "\n" if prefix else "") + "\n".join(blocks)
    if isinstance(item, dict) and "text" in item:
        return str(item["text"])
    raise ValueError(f"script item must be a string, {{'text': ...}} or {{'tool_call': ...}}: {item!r}")


class Script:
    """Maps a prompt to the scripted token ids of its next assistant turn."""

    def __init__(self, turns: list[Any], tokenizer, eos_id: int) -> None:
        if not turns:
            raise ValueError("a script needs at least one turn")
        self.turn_ids = [tokenizer.encode(turn_text(t), add_special_tokens=False) + [eos_id] for t in turns]
        start = tokenizer.convert_tokens_to_ids(IM_START)
        role = tokenizer.encode(ASSISTANT_TOKEN_TEXT, add_special_tokens=False)
        self.marker = [start, *role]

    @classmethod
    def load(cls, path: str | Path, tokenizer, eos_id: int) -> Script:
        return cls(json.loads(Path(path).read_text()), tokenizer, eos_id)

    def turn_index(self, prompt_ids: list[int]) -> int:
        """Assistant turns already in the prompt (the generation prompt's own header is not counted)."""
        m, n = self.marker, len(self.marker)
        count = sum(1 for i in range(len(prompt_ids) - n + 1) if prompt_ids[i:i + n] == m)
        return max(count - 1, 0)

    def ids_for(self, prompt_ids: list[int]) -> list[int]:
        return self.turn_ids[min(self.turn_index(prompt_ids), len(self.turn_ids) - 1)]
