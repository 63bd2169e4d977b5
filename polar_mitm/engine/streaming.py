"""Streaming text: token ids arrive one by one; clients get text deltas that add up to the final text."""

from __future__ import annotations

from polar_mitm.engine.generation import Generation
from polar_mitm.engine.parsers import ParsedStream  # noqa: F401  (moved to parsers.py: the gateway shares it)
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
