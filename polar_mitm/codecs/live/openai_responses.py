"""OpenAI Responses, live: response.created / in_progress at once, output items as the answer grows, then
response.completed (or .incomplete when the token budget ran out) carrying the whole Response.

Reasoning deltas stream into a reasoning item's summary text; text deltas into a message item; each tool call is
one whole function_call (or custom_tool_call) item. Items keep the ids the JSON answer gives them.

A compaction request (remote compaction v2: `Conversation.compaction`) answers one compaction item: added (empty)
at the first delta, a response.compaction.compacting event (no content) for each delta, done with the sealed summary
at the end, then response.completed. The summary's text never streams.
"""

from __future__ import annotations

import json
from typing import Any

from polar_mitm.codecs.base import GatewayError
from polar_mitm.codecs.live.base import Delta, LiveStream, StreamHead
from polar_mitm.codecs.openai_common import id_core
from polar_mitm.codecs.openai_responses import (
    OpenAIResponsesCodec,
    _custom_input,
    _EventCounter,
    _output_text_part,
    _response,
    _stream_custom_tool_call,
    _stream_function_call,
    compaction_added,
    compaction_compacting,
    seal_reasoning,
)
from polar_mitm.conversation import Completion, Conversation


class OpenAIResponsesLive(LiveStream):
    """The Responses event stream, written as deltas arrive."""

    def __init__(self, conv: Conversation, head: StreamHead) -> None:
        super().__init__(conv, head)
        self.core = id_core(head.id)
        self.events = _EventCounter()
        self.items: list[
            dict[str, Any]
        ] = []  # output items, in the order they were added (final form once done)
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written
        self.text = ""  # the open item's text so far
        self.calls = 0

    def start(self) -> bytes:
        placeholder = Completion(
            id=self.head.id,
            model=self.head.model,
            content="",
            reasoning=None,
            tool_calls=[],
            finish_reason="stop",
            prompt_ids=[],
            completion_ids=[],
            completion_logprobs=[],
        )
        started = {
            **_response(self.conv, placeholder, self.core),
            "status": "in_progress",
            "output": [],
            "usage": None,
            "incomplete_details": None,
            "completed_at": None,
        }
        return self.events.emit("response.created", response=started) + self.events.emit(
            "response.in_progress", response=started
        )

    def delta(self, delta: Delta) -> bytes:
        if self.conv.compaction:  # the summary goes out whole, sealed, at the end
            return self._compaction_open() + compaction_compacting(self.events, 0, f"cmp_{self.core}")
        if delta.kind == "tool_call":
            return self._close("completed") + self._call(delta)
        kind = "reasoning" if delta.kind == "reasoning" else "message"
        out = (
            b""
            if self.open is not None and self.open["type"] == kind
            else self._close("completed") + self._open(kind)
        )
        self.text += delta.text
        ids = {"item_id": self.open["id"], "output_index": len(self.items) - 1}
        if kind == "reasoning":
            return out + self.events.emit(
                "response.reasoning_summary_text.delta", **ids, summary_index=0, delta=delta.text
            )
        return out + self.events.emit(
            "response.output_text.delta", **ids, content_index=0, delta=delta.text, logprobs=[]
        )

    def finish(self, completion: Completion) -> bytes:
        if self.conv.compaction:
            final = _response(self.conv, completion, self.core)  # its output: the compaction item alone
            out = self._compaction_open() + self.events.emit(
                "response.output_item.done", output_index=0, item=final["output"][0]
            )
            return out + self.events.emit(f"response.{final['status']}", response=final)
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        out = self._close(status)
        if not any(item["type"] == "message" for item in self.items) and not self.calls:
            out += self._open("message") + self._close(status)  # the JSON answer always has a message then
        final = _response(self.conv, completion, self.core)
        final["output"] = self.items
        return out + self.events.emit(f"response.{final['status']}", response=final)

    def fail(self, error: GatewayError) -> bytes:
        body = json.loads(OpenAIResponsesCodec().encode_error(error).body)["error"]
        return self.events.emit("error", code=body["code"], message=body["message"], param=None)

    def _compaction_open(self) -> bytes:
        """The compaction item's output_item.added, the first time only."""
        if self.items:
            return b""
        self.items.append({"id": f"cmp_{self.core}", "type": "compaction"})
        return compaction_added(self.events, 0, f"cmp_{self.core}")

    def _open(self, kind: str) -> bytes:
        n_same = sum(item["type"] == kind for item in self.items)
        prefix = "rs" if kind == "reasoning" else "msg"
        item_id = f"{prefix}_{self.core}" + (f"_{n_same}" if n_same else "")
        if kind == "reasoning":
            item: dict[str, Any] = {"id": item_id, "type": "reasoning", "summary": []}
        else:
            item = {
                "id": item_id,
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
        self.open, self.text = item, ""
        self.items.append(item)
        index = len(self.items) - 1
        ids = {"item_id": item_id, "output_index": index}
        out = self.events.emit("response.output_item.added", output_index=index, item=dict(item))
        if kind == "reasoning":
            return out + self.events.emit(
                "response.reasoning_summary_part.added",
                **ids,
                summary_index=0,
                part={"type": "summary_text", "text": ""},
            )
        return out + self.events.emit(
            "response.content_part.added", **ids, content_index=0, part=_output_text_part("")
        )

    def _close(self, status: str) -> bytes:
        item, text = self.open, self.text
        if item is None:
            return b""
        self.open = None
        index = len(self.items) - 1
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            item["summary"] = [part]
            if "reasoning.encrypted_content" in self.conv.extra.get("include", []):
                item["encrypted_content"] = seal_reasoning(text)
            out = self.events.emit(
                "response.reasoning_summary_text.done", **ids, summary_index=0, text=text
            ) + self.events.emit("response.reasoning_summary_part.done", **ids, summary_index=0, part=part)
        else:
            part = _output_text_part(text)
            item["content"], item["status"] = [part], status
            out = self.events.emit(
                "response.output_text.done", **ids, content_index=0, text=text, logprobs=[]
            ) + self.events.emit("response.content_part.done", **ids, content_index=0, part=part)
        return out + self.events.emit("response.output_item.done", output_index=index, item=item)

    def _call(self, delta: Delta) -> bytes:
        call, index = delta.call, self.calls
        assert call is not None
        self.calls += 1
        call_id = call.id or f"call_{self.core}_{index}"
        if call.name in set(self.conv.extra.get("custom_tools", [])):
            item: dict[str, Any] = {
                "id": f"ctc_{self.core}_{index}",
                "type": "custom_tool_call",
                "call_id": call_id,
                "name": call.name,
                "input": _custom_input(call),
            }
            stream = _stream_custom_tool_call
        else:
            item = {
                "id": f"fc_{self.core}_{index}",
                "type": "function_call",
                "call_id": call_id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
            stream = _stream_function_call
        self.items.append(item)
        return b"".join(stream(self.events, len(self.items) - 1, item))
