"""Output parsers, named as SGLang's server flags: `--tool-call-parser qwen25`, `--reasoning-parser qwen3`.

They split the decoded completion into reasoning, visible content and tool calls. Token ids are never touched:
parsing only shapes the chat answer; the records keep the raw sampled ids. One module for the embedded engine and
the gateway: on vLLM's token-in endpoint (`/v1/completions`, raw text back) the gateway parses with these same
functions, so a model family's answers are split the same way whichever engine sampled them. The `<tool_call>`
blocks are found here; what a block holds is read by the tool-call parser's format (`tool_call_formats.py`: JSON
for `hermes`/`qwen25`, XML for `qwen3_coder`). Standard library only: the gateway imports it without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from polar_mitm.engine.tool_call_formats import OfferedTools, ParsedCall, tool_call_format

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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
        return stripped[len("<think>") :].strip("\n"), ""
    return None, text


def parse_tool_calls(text: str, parser: str, offered: OfferedTools = None) -> tuple[str, list[ParsedCall]]:
    """(content, calls). A block that is not a valid call stays in the content, as text.

    Valid: a call in the parser's notation naming a tool the request offers (`offered`: the request's tool names,
    or name → parameters schema, which `qwen3_coder` needs to type its values; None = any name). A small model
    writes broken JSON or XML, arguments that are not an object, parameters or tools it was never given; passing
    those on as calls would crash the harness or make it run a tool that does not exist, so the harness gets the
    text instead (the record keeps the sampled ids either way). SGLang's own parsers drop such blocks; keeping them
    as text loses nothing. An unknown parser name raises `UnknownToolCallParser`.
    """
    fmt = tool_call_format(parser)
    if fmt is None or "<tool_call>" not in text:
        return text, []
    calls: list[ParsedCall] = []
    kept: list[str] = []
    last = 0
    for match in TOOL_CALL_RE.finditer(text):
        call = fmt.parse_block(match.group(1), offered)
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return content, calls


def parse_output(
    text: str,
    *,
    tool_call_parser: str,
    reasoning_parser: str,
    tools_given: bool,
    offered: OfferedTools = None,
) -> ParsedOutput:
    """Reasoning, content and tool calls of a finished completion (`offered`: the request's tools)."""
    reasoning, rest = split_reasoning(text, reasoning_parser)
    content, calls = parse_tool_calls(rest, tool_call_parser if tools_given else "none", offered)
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=calls)


class StreamingSplitter:
    """Incremental version of `parse_output` for streamed chat chunks.

    Text arrives in pieces; a piece that might be the start of a tag (`<think>`, `</think>`, `<tool_call>`) is held
    back until it is decided. Yields ("content" | "reasoning", text) deltas and ("tool_call", ParsedCall) items.
    """

    TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

    def __init__(
        self,
        *,
        tool_call_parser: str,
        reasoning_parser: str,
        tools_given: bool,
        offered: OfferedTools = None,
    ) -> None:
        self.tool_call_parser = tool_call_parser
        self.tools = tools_given and tool_call_format(tool_call_parser) is not None
        self.offered = offered
        self.reasoning = reasoning_parser != "none"
        self.mode = "start"  # start → (reasoning →) content ⇄ tool
        self.buffer = ""

    def feed(self, piece: str, *, final: bool = False) -> list[tuple[str, object]]:
        self.buffer += piece
        out: list[tuple[str, object]] = []
        while self.buffer:
            if self.mode == "start":
                stripped = self.buffer.lstrip()
                if self.reasoning and stripped.startswith("<think>"):
                    self.buffer = stripped[len("<think>") :].lstrip("\n")
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
                    self.buffer = self.buffer[idx + len("</think>") :].lstrip("\n")
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
                self.buffer = self.buffer[idx + len("</tool_call>") :]
                content, calls = parse_tool_calls(block, self.tool_call_parser, self.offered)
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


class ParsedStream:
    """Shapes the streaming splitter's pieces so that they add up to what `parse_output` makes of the whole text.

    The splitter sees text piece by piece; the non-streamed parser sees it whole and trims it: newlines around the
    reasoning, the newlines after `</think>`, and — when the answer holds tool calls — whitespace at both ends of
    the content. Streamed text cannot be taken back, so whitespace that the whole-text parse might trim is held
    until it is decided. One case stays open: leading whitespace of content written *before* a later tool call
    (known only at the end) is streamed, while the whole-text parse drops it.
    """

    def __init__(self, *, tools_active: bool, reasoning_active: bool) -> None:
        self.tools_active, self.reasoning_active = tools_active, reasoning_active
        self.raw = ""  # the text fed so far (to know whether the answer opened with <think>)
        self.held_reasoning = ""  # trailing newlines of the reasoning so far
        self.held_content = ""  # trailing whitespace of the content so far (tools active)
        self.reasoning_started = self.content_started = False
        self.calls = 0

    def note_text(self, piece: str) -> None:
        """The raw text the splitter is about to see."""
        if len(self.raw) < 16:
            self.raw += piece

    def shape(self, pieces: list[tuple[str, object]]) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for kind, value in pieces:
            if kind == "reasoning":
                out.extend(self._reasoning(str(value)))
            elif kind == "content":
                out.extend(self._content(str(value)))
            else:
                self.calls += 1
                out.append((kind, value))
        return out

    def finish(self) -> list[tuple[str, object]]:
        """At the end: trailing content whitespace is kept only when there was no tool call."""
        held, self.held_content = self.held_content, ""
        return [("content", held)] if held and self.calls == 0 else []

    def _reasoning(self, text: str) -> list[tuple[str, object]]:
        text = self.held_reasoning + text
        if not self.reasoning_started:
            text = text.lstrip("\n")
        body = text.rstrip("\n")
        self.held_reasoning = text[len(body) :]
        if not body:
            return []
        self.reasoning_started = True
        return [("reasoning", body)]

    def _content(self, text: str) -> list[tuple[str, object]]:
        self.held_reasoning = ""  # the reasoning is over: its trailing newlines are trimmed
        if not self.content_started and self.reasoning_active and self.raw.lstrip().startswith("<think>"):
            text = text.lstrip("\n")  # the newlines after </think>
        if not self.tools_active:
            if text:
                self.content_started = True
                return [("content", text)]
            return []
        text = self.held_content + text
        if not self.content_started and self.calls:
            text = text.lstrip()
        body = text.rstrip()
        self.held_content = text[len(body) :]
        if not body:
            return []
        self.content_started = True
        return [("content", body)]


class TextStreamParser:
    """Streamed text in, parsed pieces out: `StreamingSplitter` + `ParsedStream`, so that the pieces add up to what
    `parse_output` makes of the whole text (the embedded engine's streams and the gateway's vLLM streams)."""

    def __init__(
        self,
        *,
        tool_call_parser: str,
        reasoning_parser: str,
        tools_given: bool,
        offered: OfferedTools = None,
    ) -> None:
        self.splitter = StreamingSplitter(
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            tools_given=tools_given,
            offered=offered,
        )
        self.shaper = ParsedStream(tools_active=self.splitter.tools, reasoning_active=self.splitter.reasoning)

    def feed(self, text: str, *, final: bool = False) -> list[tuple[str, object]]:
        """("content" | "reasoning", str) and ("tool_call", ParsedCall) pieces; `final` flushes what was held."""
        self.shaper.note_text(text)
        pieces = self.shaper.shape(self.splitter.feed(text, final=final))
        return pieces + self.shaper.finish() if final else pieces
