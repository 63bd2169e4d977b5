"""Google GenerateContent, live: one GenerateContentResponse chunk per delta, then a last chunk (no parts) with
finishReason and usageMetadata. SSE with `alt=sse` (what google-genai and Gemini CLI use), else the API's JSON
array, opened at once and closed at the end.

Thought parts are sent only when the request set includeThoughts, as in the JSON answer; a function call is one
whole `functionCall` part.
"""

from __future__ import annotations

import json
from typing import Any

from polar_mitm.codecs.base import GatewayError
from polar_mitm.codecs.common import sse_event
from polar_mitm.codecs.google import GoogleCodec, _call_parts, _chunk
from polar_mitm.codecs.live.base import Delta, LiveStream, StreamHead
from polar_mitm.conversation import Completion, Conversation


class GoogleLive(LiveStream):
    """GenerateContentResponse chunks, written as deltas arrive."""

    def __init__(self, conv: Conversation, head: StreamHead) -> None:
        super().__init__(conv, head)
        self.sse = conv.extra.get("alt") == "sse"
        self.content_type = "text/event-stream" if self.sse else "application/json"
        self.sent = 0

    def _frame(self, payload: dict[str, Any]) -> bytes:
        if self.sse:
            return sse_event(payload)
        prefix = b"" if self.sent == 0 else b",\r\n"
        self.sent += 1
        return prefix + json.dumps(payload, ensure_ascii=False).encode()

    def _parts_chunk(self, parts: list[dict[str, Any]]) -> bytes:
        candidate = {"content": {"role": "model", "parts": parts}, "index": 0}
        return self._frame(
            {
                "candidates": [candidate],
                "modelVersion": self.conv.model or self.head.model,
                "responseId": self.head.id or "polar-response",
            }
        )

    def start(self) -> bytes:
        return b"" if self.sse else b"["

    def keepalive(self) -> bytes:
        return super().keepalive() if self.sse else b""  # a JSON array has no comment syntax

    def delta(self, delta: Delta) -> bytes:
        if delta.kind == "reasoning":
            # Gemini hides thoughts unless the request set includeThoughts.
            return (
                self._parts_chunk([{"text": delta.text, "thought": True}])
                if self.conv.thinking is True
                else b""
            )
        if delta.kind == "text":
            return self._parts_chunk([{"text": delta.text}])
        assert delta.call is not None
        holder = Completion(
            id="",
            model="",
            content="",
            reasoning=None,
            tool_calls=[delta.call],
            finish_reason="tool_calls",
            prompt_ids=[],
            completion_ids=[],
            completion_logprobs=[],
        )
        return self._parts_chunk(_call_parts(holder))

    def finish(self, completion: Completion) -> bytes:
        out = self._frame(_chunk(self.conv, completion, [], final=True))
        return out if self.sse else out + b"]"

    def fail(self, error: GatewayError) -> bytes:
        payload = json.loads(GoogleCodec().encode_error(error).body)
        return sse_event(payload) if self.sse else self._frame(payload) + b"]"
