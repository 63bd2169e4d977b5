"""OpenAI's remote compaction endpoint, `POST …/responses/compact`, answered by sampling the summary from the engine.

Codex compacts a long thread through this endpoint (remote compaction v1) when its provider is OpenAI's (proxy
mode); Codex 0.171 uses v2 there instead, a Responses call whose input ends with a `compaction_trigger` item,
answered by the Responses codec (openai_responses.py) with the same sealed summary. OpenAI summarises
server-side and answers `{"object": "response.compaction", "output": [kept user messages…, {"type":
"compaction", "encrypted_content": …}]}`; the harness replaces its history with that output and sends it back
on later calls. Here the summary is a normal engine call — the thread as a Responses request plus a compaction
instruction, sampled and recorded like any other call (`call_kind = "compaction"`) — and the compaction item's
`encrypted_content` is the sealed summary, which the Responses codec turns back into its text on later calls.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

from polar_mitm.codecs.openai_responses import COMPACT_INSTRUCTION, OpenAIResponsesCodec, compaction_item
from polar_mitm.conversation import Completion, Conversation, Message

__all__ = ["COMPACT_INSTRUCTION", "ResponsesCompactCodec"]


class ResponsesCompactCodec(OpenAIResponsesCodec):
    """`…/responses/compact`: a Responses request in, a compaction answer out (never streamed)."""

    key: ClassVar[str] = (
        "openai_responses_compact"  # its CODECS key; records keep provider "openai_responses"
    )
    hosts: ClassVar[tuple[str, ...]] = ()  # the Responses codec answers for the host
    call_path: ClassVar[str] = "/responses/compact"
    websocket_first: ClassVar[bool] = False
    compaction: ClassVar[bool] = True

    def stream_requested(self, body: dict[str, Any], path: str, query: dict[str, str]) -> bool:
        return False

    def decode_request(self, body: Any, path: str, query: dict[str, str]) -> Conversation:
        if isinstance(body, dict):  # the compact body has no streaming or output options of its own
            body = {k: v for k, v in body.items() if k not in ("stream", "text", "tool_choice")}
        conv = super().decode_request(body, path, query)
        if not conv.compaction:  # (an input ending with a compaction_trigger already has the instruction)
            conv.messages.append(Message(role="user", content=COMPACT_INSTRUCTION))
        conv.stream, conv.tool_choice, conv.compaction = False, "none", True  # the summary is text
        conv.extra["kept_user_messages"] = [m.content for m in conv.messages[:-1] if m.role == "user"]
        return conv

    def encode_response(self, conv: Conversation, completion: Completion) -> dict[str, Any]:
        kept = [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
            for text in conv.extra.get("kept_user_messages", [])
        ]
        compaction = compaction_item(completion, uuid.uuid4().hex)
        return {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": [*kept, compaction],
            "usage": {
                "input_tokens": completion.prompt_tokens,
                "output_tokens": completion.completion_tokens,
                "total_tokens": completion.prompt_tokens + completion.completion_tokens,
            },
        }

    def encode_stream(self, conv: Conversation, completion: Completion) -> Iterator[bytes]:
        raise NotImplementedError("responses/compact is never streamed")
