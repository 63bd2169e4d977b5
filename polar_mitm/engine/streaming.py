"""Streaming text: token ids arrive one by one; clients get text deltas that add up to the final text."""

from __future__ import annotations

from polar_mitm.engine.generation import Generation
from polar_mitm.engine.sampling import SamplingParams


class IncrementalDecoder:
    """Turns a growing id list into text deltas without re-decoding everything (and never splits a UTF-8 char)."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip
        )
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""


class IncrementalText:
    """Streamed text deltas whose concatenation equals the final, stop-trimmed text of the generation.

    Text that could be the beginning of a stop string is held back until the generation decides it.
    """

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.decoder = IncrementalDecoder(tokenizer, params.skip_special_tokens)
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def push(self, token_id: int) -> str:
        self.text += self.decoder.push(token_id)
        upto = max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta

    def finish(self, gen: Generation) -> str:
        final = gen.text
        delta = final[self.emitted :] if len(final) >= self.emitted else ""
        self.emitted = len(final)
        return delta


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
