"""Output parsers, named as SGLang's server flags: `--tool-call-parser qwen25`, `--reasoning-parser qwen3`.

They split the decoded completion into reasoning, visible content and tool calls. Token ids are never touched:
parsing only shapes the chat answer; the records keep the raw sampled ids.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_CALL_PARSERS = ("qwen25", "none")
REASONING_PARSERS = ("qwen3", "none")


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self, index: int) -> dict:
        return {"id": self.id, "index": index, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None = None
    tool_calls: list[ParsedCall] = field(default_factory=list)


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning, rest). An unclosed `<think>` (a truncated turn) is all reasoning."""
    if parser == "none":
        return None, text
    stripped = text.lstrip()
    if "</think>" in text:
        head, _, rest = text.partition("</think>")
        return head.replace("<think>", "", 1).strip("\n"), rest.lstrip("\n")
    if stripped.startswith("<think>"):
        return stripped[len("<think>"):].strip("\n"), ""
    return None, text


def parse_tool_calls(text: str, parser: str) -> tuple[str, list[ParsedCall]]:
    """(content, calls). A block that is not valid `{"name", "arguments"}` JSON stays in the content."""
    if parser == "none" or "<tool_call>" not in text:
        return text, []
    calls: list[ParsedCall] = []
    kept: list[str] = []
    last = 0
    for match in TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(match.group(1))
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError("name")
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ParsedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=arguments))
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return content, calls


def parse_output(text: str, *, tool_call_parser: str, reasoning_parser: str, tools_given: bool) -> ParsedOutput:
    reasoning, rest = split_reasoning(text, reasoning_parser)
    content, calls = parse_tool_calls(rest, tool_call_parser if tools_given else "none")
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=calls)


class StreamingSplitter:
    """Incremental version of `parse_output` for streamed chat chunks.

    Text arrives in pieces; a piece that might be the start of a tag (`<think>`, `</think>`, `<tool_call>`) is held
    back until it is decided. Yields ("content" | "reasoning", text) deltas and ("tool_call", ParsedCall) items.
    """

    TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

    def __init__(self, *, tool_call_parser: str, reasoning_parser: str, tools_given: bool) -> None:
        self.tools = tools_given and tool_call_parser != "none"
        self.reasoning = reasoning_parser != "none"
        self.mode = "start"  # start → (reasoning →) content ⇄ tool
        self.buffer = ""
        self.seen_text = False

    def feed(self, piece: str, *, final: bool = False) -> list[tuple[str, object]]:
        self.buffer += piece
        out: list[tuple[str, object]] = []
        while self.buffer:
            if self.mode == "start":
                stripped = self.buffer.lstrip()
                if self.reasoning and stripped.startswith("<think>"):
                    self.buffer = stripped[len("<think>"):].lstrip("\n")
                    self.mode = "reasoning"
                    continue
                if not final and self.reasoning and "<think>".startswith(stripped):
                    break  # undecided: maybe a <think> is coming
                self.mode = "content"
                continue
            if self.mode == "reasoning":
                idx = self.buffer.find("</think>")
                if idx >= 0:
                    if idx:
                        out.append(("reasoning", self.buffer[:idx].rstrip("\n")))
                    self.buffer = self.buffer[idx + len("</think>"):].lstrip("\n")
                    self.mode = "content"
                    continue
                safe = self._safe_prefix(final)
                if safe:
                    out.append(("reasoning", self.buffer[:safe]))
                    self.buffer = self.buffer[safe:]
                break
            if self.mode == "content":
                idx = self.buffer.find("<tool_call>") if self.tools else -1
                if idx >= 0:
                    if idx:
                        out.append(("content", self.buffer[:idx]))
                    self.buffer = self.buffer[idx:]
                    self.mode = "tool"
                    continue
                safe = self._safe_prefix(final) if self.tools else len(self.buffer)
                if safe:
                    out.append(("content", self.buffer[:safe]))
                    self.buffer = self.buffer[safe:]
                break
            if self.mode == "tool":
                idx = self.buffer.find("</tool_call>")
                if idx < 0:
                    if final:
                        out.append(("content", self.buffer))  # unterminated: stays visible text
                        self.buffer = ""
                    break
                block = self.buffer[: idx + len("</tool_call>")]
                self.buffer = self.buffer[idx + len("</tool_call>"):]
                content, calls = parse_tool_calls(block, "qwen25")
                if calls:
                    out.extend(("tool_call", c) for c in calls)
                else:
                    out.append(("content", block))
                self.mode = "content"
        return out

    def _safe_prefix(self, final: bool) -> int:
        """Length of the buffer that cannot be the start of a tag."""
        if final:
            return len(self.buffer)
        cut = self.buffer.rfind("<")
        if cut >= 0 and any(tag.startswith(self.buffer[cut:]) for tag in self.TAGS):
            return cut
        return len(self.buffer)
