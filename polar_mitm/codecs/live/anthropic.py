"""Anthropic Messages, live: message_start and ping at once, content blocks as the answer grows, then
message_delta (stop reason, usage) and message_stop.

Thinking deltas open a thinking block (its signature is sent when the block closes); text deltas a text block;
each tool call is one whole tool_use block (its input as `input_json_delta`). Keep-alive is the API's own `ping`.
"""

from __future__ import annotations

import json

from polar_mitm.codecs.anthropic import (
    AnthropicCodec,
    _anthropic_id,
    _block_events,
    _message_id,
    _signature,
    _stop_reason,
    _tool_input,
    _usage,
)
from polar_mitm.codecs.base import GatewayError
from polar_mitm.codecs.common import sse_event
from polar_mitm.codecs.live.base import Delta, LiveStream, StreamHead
from polar_mitm.conversation import Completion, Conversation


def _event(payload: dict) -> bytes:
    return sse_event(payload, event=payload["type"])


class AnthropicLive(LiveStream):
    """Anthropic's event stream, written as deltas arrive."""

    def __init__(self, conv: Conversation, head: StreamHead) -> None:
        super().__init__(conv, head)
        self.index = -1  # of the last content block opened
        self.open_kind: str | None = None  # "thinking" | "text" while a block is open
        self.thinking = ""  # the open thinking block's text (its signature covers it)

    def start(self) -> bytes:
        usage = {
            "input_tokens": self.head.prompt_tokens,
            "output_tokens": 1,  # as the API does before sampling
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        message = {
            "id": _message_id(self.head.id),
            "type": "message",
            "role": "assistant",
            "model": self.conv.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return _event({"type": "message_start", "message": message}) + self.keepalive()

    def keepalive(self) -> bytes:
        return _event({"type": "ping"})

    def delta(self, delta: Delta) -> bytes:
        if delta.kind == "tool_call":
            assert delta.call is not None
            block = {
                "type": "tool_use",
                "id": _anthropic_id("toolu_", delta.call.id),
                "name": delta.call.name,
                "input": _tool_input(delta.call),
            }
            out = self._close()
            self.index += 1
            return out + b"".join(_event(e) for e in _block_events(self.index, block))
        kind = "thinking" if delta.kind == "reasoning" else "text"
        out = b"" if self.open_kind == kind else self._close() + self._open(kind)
        if kind == "thinking":
            self.thinking += delta.text
            body = {"type": "thinking_delta", "thinking": delta.text}
        else:
            body = {"type": "text_delta", "text": delta.text}
        return out + _event({"type": "content_block_delta", "index": self.index, "delta": body})

    def finish(self, completion: Completion) -> bytes:
        out = self._close()
        if self.index < 0:  # nothing was said: one empty text block, as the JSON answer has
            out += self._open("text") + self._close()
        stop_reason, stop_sequence = _stop_reason(self.conv, completion)
        out += _event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": _usage(completion),
            }
        )
        return out + _event({"type": "message_stop"})

    def fail(self, error: GatewayError) -> bytes:
        payload = json.loads(AnthropicCodec().encode_error(error).body)
        return sse_event(payload, event="error")

    def _open(self, kind: str) -> bytes:
        self.index += 1
        self.open_kind = kind
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        return _event({"type": "content_block_start", "index": self.index, "content_block": block})

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        out = b""
        if self.open_kind == "thinking":
            out = _event(
                {
                    "type": "content_block_delta",
                    "index": self.index,
                    "delta": {"type": "signature_delta", "signature": _signature(self.thinking)},
                }
            )
            self.thinking = ""
        self.open_kind = None
        return out + _event({"type": "content_block_stop", "index": self.index})
