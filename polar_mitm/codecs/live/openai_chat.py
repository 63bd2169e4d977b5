"""OpenAI Chat Completions, live: `chat.completion.chunk`s as deltas arrive, then the finish chunk, the usage chunk
(with `stream_options.include_usage`) and `data: [DONE]`. Reasoning goes out as `reasoning_content` (SGLang's and
DeepSeek's field); a tool call is one chunk carrying its name and whole arguments.
"""

from __future__ import annotations

import json
import time
from typing import Any

from polar_mitm.codecs.base import GatewayError
from polar_mitm.codecs.common import SSE_DONE, sse_event
from polar_mitm.codecs.live.base import Delta, LiveStream, StreamHead
from polar_mitm.codecs.openai_chat import OpenAIChatCodec, _finish_reason, _tool_call_json, _usage
from polar_mitm.codecs.openai_common import id_core
from polar_mitm.conversation import Completion, Conversation


class OpenAIChatLive(LiveStream):
    """Chat Completions chunks, written as deltas arrive."""

    def __init__(self, conv: Conversation, head: StreamHead) -> None:
        super().__init__(conv, head)
        self.chunk_head: dict[str, Any] = {
            "id": "chatcmpl-" + id_core(head.id),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": conv.model or head.model,
            "system_fingerprint": None,
        }
        if conv.include_usage:
            self.chunk_head["usage"] = (
                None  # OpenAI sends `usage: null` on every chunk before the usage chunk
            )
        self.calls = 0

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse_event({**self.chunk_head, "choices": [choice]})

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, delta: Delta) -> bytes:
        if delta.kind == "reasoning":
            return self._chunk({"reasoning_content": delta.text})
        if delta.kind == "text":
            return self._chunk({"content": delta.text})
        assert delta.call is not None
        index, self.calls = self.calls, self.calls + 1
        return self._chunk({"tool_calls": [{"index": index, **_tool_call_json(delta.call, index)}]})

    def finish(self, completion: Completion) -> bytes:
        # The weight version is known now: the last chunks carry it, as the JSON answer does.
        self.chunk_head["system_fingerprint"] = completion.weight_version
        out = self._chunk({}, _finish_reason(completion))
        if self.conv.include_usage:
            out += sse_event({**self.chunk_head, "choices": [], "usage": _usage(completion)})
        return out + SSE_DONE

    def fail(self, error: GatewayError) -> bytes:
        return sse_event(json.loads(OpenAIChatCodec().encode_error(error).body)) + SSE_DONE
