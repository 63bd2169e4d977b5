"""OpenAI Responses (`POST …/responses`): Codex CLI's wire API (`store: false`, always streamed).

Requests carry the whole history as typed items (messages, reasoning, function calls and their outputs), which
are folded back into chat turns. Answers are a `Response` object, or the typed event stream that builds one.

Reasoning round trip: with `include: ["reasoning.encrypted_content"]` (what Codex sends) the reasoning item
carries the exact reasoning text in `encrypted_content` (base64, not encrypted: nothing here is secret), so
the next request restores the very text the model wrote even if the harness trims summaries.

Remote compaction v2 (what Codex does with OpenAI's own provider, i.e. in proxy mode): a normal, streamed
Responses call whose input ends with a `{"type": "compaction_trigger"}` item asks for a summary of the thread
instead of a turn. It is answered like `…/responses/compact` (responses_compact.py): the thread plus our compaction
instruction, no tools, sampled and recorded as a compaction (`Conversation.compaction`); the answer holds exactly
one output item, `{"type": "compaction", "encrypted_content": <the sealed summary>}`, which later calls send back
and which decodes to the summary's text.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from polar_mitm.codecs import structured
from polar_mitm.codecs.common import (
    INT64_MAX,
    invalid_request,
    optional_bool,
    optional_dict,
    optional_int,
    optional_number,
    optional_str,
    require_dict,
    require_list,
    require_str,
    sse_event,
    stream_pieces,
)
from polar_mitm.codecs.openai_common import (
    DELTA_CHARS,
    OpenAICodec,
    arguments_text,
    content_text,
    custom_tool_arguments,
    custom_tool_parameters,
    id_core,
    thinking_from_effort,
)
from polar_mitm.conversation import Completion, Conversation, Message, Tool, ToolCall

_SEALED_PREFIX = "polar-mitm.v1."
# Our compaction instruction (OpenAI's own is not public); the same task Codex's local compaction gives the model.
COMPACT_INSTRUCTION = (
    "You are performing a CONTEXT CHECKPOINT COMPACTION. Summarise the conversation so far "
    "for another model that will resume the task: the goal, what was done, what is left."
)
COMPACTION_TRIGGER = "compaction_trigger"  # the input item that makes a Responses call a compaction (v2)
_TEXT_PARTS = ("input_text", "output_text", "text")
_UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")
# Request settings kept in `Conversation.extra` (for the record and the Response echo), with their JSON types.
_EXTRA_TYPES: dict[str, tuple[type, ...]] = {
    "store": (bool,),
    "include": (list,),
    "parallel_tool_calls": (bool,),
    "metadata": (dict,),
    "prompt_cache_key": (str,),
    "instructions": (str,),
    "text": (dict,),
    "reasoning": (dict,),
    "user": (str,),
    "previous_response_id": (str,),
}
# Echoed only when the SDK's Response type knows the value: an unknown one is still honoured, just not echoed.
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES = ("auto", "concise", "detailed")
_VERBOSITIES = ("low", "medium", "high")


class OpenAIResponsesCodec(OpenAICodec):
    """Responses API ⇄ Conversation: `…/responses` under any prefix; not `…/responses/{id}` lookups."""

    name = "openai_responses"
    hosts = ("chatgpt.com",)  # Codex signed in with ChatGPT (`chatgpt.com/backend-api/codex/responses`)
    call_path = "/responses"
    websocket_first = True  # Codex opens `wss://…/v1/responses` before falling back to HTTPS

    # ---- request -------------------------------------------------------------------------------------------

    def decode_request(self, body: Any, path: str, query: dict[str, str]) -> Conversation:
        """A Responses body → Conversation; GatewayError("invalid_request") on anything malformed."""
        body = require_dict(body, "request body")
        _reject_server_state(body)
        history = _History()
        instructions = optional_str(body, "instructions")
        if instructions:
            history.messages.append(Message(role="system", content=instructions))
        raw_input = body.get("input")
        compaction = False
        if isinstance(raw_input, str):
            history.messages.append(Message(role="user", content=raw_input))
        else:
            items = require_list(raw_input if raw_input is not None else [], "input")
            for i, item in enumerate(items):
                history.add(item, f"input[{i}]")
            compaction = (
                bool(items) and isinstance(items[-1], dict) and items[-1].get("type") == COMPACTION_TRIGGER
            )
        if not history.messages:
            raise invalid_request("input must contain at least one message")
        tools, echoed_tools = _decode_tools(body.get("tools"))
        extra = _extra_fields(body)
        extra["tools"] = echoed_tools
        extra["custom_tools"] = [tool["name"] for tool in echoed_tools if tool["type"] == "custom"]
        conv = Conversation(
            messages=history.messages,
            model=optional_str(body, "model") or "",
            tools=tools,
            tool_choice=_decode_tool_choice(body.get("tool_choice")),
            max_tokens=optional_int(body, "max_output_tokens", minimum=1, maximum=INT64_MAX),
            temperature=optional_number(body, "temperature"),
            top_p=optional_number(body, "top_p"),
            top_k=optional_int(body, "top_k", minimum=-1),
            stream=bool(optional_bool(body, "stream")),
            thinking=thinking_from_effort(extra.get("reasoning", {}).get("effort"), "reasoning.effort"),
            extra=extra,
            response_format=structured.from_responses_text(body.get("text")),
        )
        if (
            compaction
        ):  # remote compaction v2: the thread + our instruction, answered as free text with no tools
            conv.messages.append(Message(role="user", content=COMPACT_INSTRUCTION))
            conv.tool_choice, conv.response_format, conv.compaction = "none", None, True
        return conv

    # ---- answers -------------------------------------------------------------------------------------------

    def encode_response(self, conv: Conversation, completion: Completion) -> dict[str, Any]:
        """The finished `Response` object, echoing the request's settings as OpenAI does."""
        return _response(conv, completion, id_core(completion.id))

    def encode_stream(self, conv: Conversation, completion: Completion) -> Iterator[bytes]:
        """created → in_progress → each output item's events → completed (or incomplete)."""
        final = _response(conv, completion, id_core(completion.id))
        events = _EventCounter()
        started = {
            **final,
            "status": "in_progress",
            "output": [],
            "usage": None,
            "incomplete_details": None,
            "completed_at": None,
        }
        yield events.emit("response.created", response=started)
        yield events.emit("response.in_progress", response=started)
        for index, item in enumerate(final["output"]):
            yield from _ITEM_STREAMS[item["type"]](events, index, item)
        yield events.emit(f"response.{final['status']}", response=final)


# ---- decoding helpers --------------------------------------------------------------------------------------


def _reject_server_state(body: dict[str, Any]) -> None:
    """History kept by OpenAI's servers (`store`) cannot be resolved here: the harness must send it all."""
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise invalid_request("previous_response_id must be a string")
    if previous:
        raise invalid_request("previous_response_id is not supported; send the full input")
    if body.get("conversation"):
        raise invalid_request("conversation is not supported; send the full input")


@dataclass
class _History:
    """Folds Responses input items, in order, into chat messages.

    Reasoning waits for the assistant turn that follows it; function calls join the assistant message just
    before them, because one engine answer is one message (reasoning, text, then tool calls).
    """

    messages: list[Message] = field(default_factory=list)
    pending_reasoning: str | None = None
    call_names: dict[str, str] = field(default_factory=dict)  # call_id → tool name, for tool results

    def add(self, raw: Any, where: str) -> None:
        item = require_dict(raw, where)
        kind = item.get("type")
        if kind is None or kind == "message":
            self._message(item, where)
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            self.pending_reasoning = "\n\n".join(t for t in (self.pending_reasoning, text) if t)
        elif kind == "function_call":
            self._call(
                require_str(item.get("call_id"), f"{where}.call_id"),
                require_str(item.get("name"), f"{where}.name"),
                arguments_text(item.get("arguments"), f"{where}.arguments"),
            )
        elif kind == "custom_tool_call":
            self._call(
                require_str(item.get("call_id"), f"{where}.call_id"),
                require_str(item.get("name"), f"{where}.name"),
                custom_tool_arguments(require_str(item.get("input"), f"{where}.input")),
            )
        elif kind == "local_shell_call":
            action = require_dict(item.get("action"), f"{where}.action")
            call_id = require_str(item.get("call_id") or item.get("id"), f"{where}.call_id")
            self._call(call_id, "local_shell", arguments_text(action, f"{where}.action"))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self._result(
                require_str(item.get("call_id"), f"{where}.call_id"),
                _output_text(item.get("output"), f"{where}.output"),
            )
        elif kind == "local_shell_call_output":
            self._result(
                require_str(item.get("call_id") or item.get("id"), f"{where}.id"),
                require_str(item.get("output"), f"{where}.output"),
            )
        elif kind in ("compaction", "compaction_summary"):
            # A summary from `…/responses/compact` (responses_compact.py): the thread continues from its text.
            summary = unseal_reasoning(str(item.get("encrypted_content") or ""))
            if summary is not None:
                self.pending_reasoning = None
                self.messages.append(Message(role="user", content=summary))
        elif kind == "item_reference":
            raise invalid_request(
                f"{where}: item_reference needs stored responses, which are not supported; "
                "send the full input"
            )
        elif not isinstance(kind, str):
            raise invalid_request(f"{where}.type must be a string")
        # Other items (hosted-tool calls such as web_search_call, a compaction_trigger — which, last, makes the
        # call a compaction: decode_request) mean nothing to a local model.

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise invalid_request(f"{where}.role must be one of user, assistant, system, developer")
        content = _content_text(item.get("content"), f"{where}.content")
        if role == "assistant":
            self.messages.append(Message(role="assistant", content=content, reasoning=self._take_reasoning()))
            return
        self.pending_reasoning = None  # reasoning with no assistant turn after it has nowhere to go
        self.messages.append(Message(role="user" if role == "user" else "system", content=content))

    def _call(self, call_id: str, name: str, arguments: str) -> None:
        self.call_names[call_id] = name
        call = ToolCall(id=call_id, name=name, arguments=arguments)
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant" and self.pending_reasoning is None:
            last.tool_calls.append(call)
        else:
            reasoning = self._take_reasoning()
            self.messages.append(Message(role="assistant", reasoning=reasoning, tool_calls=[call]))

    def _result(self, call_id: str, output: str) -> None:
        self.pending_reasoning = None
        self.messages.append(
            Message(role="tool", content=output, tool_call_id=call_id, name=self.call_names.get(call_id))
        )

    def _take_reasoning(self) -> str | None:
        reasoning, self.pending_reasoning = self.pending_reasoning, None
        return reasoning or None


def _content_text(content: Any, where: str) -> str:
    """A message's content: a string or a list of text parts, concatenated."""
    return content_text(content, where, _TEXT_PARTS, _UNSUPPORTED_PARTS)


def _output_text(output: Any, where: str) -> str:
    """A tool output: a string or a list of content parts."""
    if output is None:
        raise invalid_request(f"{where} is required")
    return _content_text(output, where)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The reasoning text of a reasoning item: our sealed copy, else the raw content, else the summaries."""
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str):
        text = unseal_reasoning(sealed)
        if text is not None:
            return text
    for key, separator in (("content", ""), ("summary", "\n\n")):
        parts = item.get(key)
        if parts:
            return separator.join(
                require_str(require_dict(part, f"{where}.{key}[{j}]").get("text"), f"{where}.{key}[{j}].text")
                for j, part in enumerate(require_list(parts, f"{where}.{key}"))
            )
    return ""


def _decode_tools(value: Any) -> tuple[list[Tool], list[dict[str, Any]]]:
    """Function and custom tools (custom ones take one string, `input`), and their Response echo.

    Hosted tools (web_search, local_shell, file_search…) are skipped: OpenAI runs them, a local model cannot.
    """
    tools: list[Tool] = []
    echoed: list[dict[str, Any]] = []
    for j, raw in enumerate(require_list(value if value is not None else [], "tools")):
        where = f"tools[{j}]"
        tool = require_dict(raw, where)
        kind = tool.get("type")
        if kind not in ("function", "custom"):
            continue
        name = require_str(tool.get("name"), f"{where}.name")
        if not name:
            raise invalid_request(f"{where}.name must not be empty")
        description = optional_str(tool, "description", f"{where}.") or ""
        echo: dict[str, Any] = {"type": kind, "name": name, "description": description}
        if kind == "custom":
            parameters = custom_tool_parameters(tool.get("format"))
            if _is_input_format(tool.get("format")):
                echo["format"] = tool["format"]
        else:
            given = optional_dict(tool, "parameters", f"{where}.")
            parameters = given if given is not None else {"type": "object", "properties": {}}
            strict = tool.get("strict")
            echo.update(parameters=parameters, strict=strict if isinstance(strict, bool) else None)
        tools.append(Tool(name=name, description=description, parameters=parameters))
        echoed.append(echo)
    return tools, echoed


def _is_input_format(value: Any) -> bool:
    """A custom tool's `format` as OpenAI defines it: plain text, or a lark/regex grammar."""
    if not isinstance(value, dict):
        return False
    if value.get("type") == "text":
        return True
    return (
        value.get("type") == "grammar"
        and value.get("syntax") in ("lark", "regex")
        and isinstance(value.get("definition"), str)
    )


def _decode_tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise invalid_request("tool_choice must be auto, none, required or a named tool")
        return value
    choice = require_dict(value, "tool_choice")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        return {"name": require_str(choice.get("name"), "tool_choice.name")}
    if kind == "allowed_tools":
        mode = choice.get("mode")
        if mode not in ("auto", "required"):
            raise invalid_request("tool_choice.mode must be auto or required")
        return mode
    if not isinstance(kind, str):
        raise invalid_request("tool_choice.type must be a string")
    return "auto"  # forcing a hosted tool: there is none here, let the model choose


def _extra_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Request settings with no engine meaning, type-checked as OpenAI does."""
    extra: dict[str, Any] = {}
    for key, types in _EXTRA_TYPES.items():
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise invalid_request(f"{key} has the wrong type")
        extra[key] = value
    if not all(isinstance(entry, str) for entry in extra.get("include", [])):
        raise invalid_request("include must be an array of strings")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.get("metadata", {}).items()):
        raise invalid_request("metadata must map strings to strings")
    for key in ("effort", "summary"):
        if not isinstance(extra.get("reasoning", {}).get(key), str | None):
            raise invalid_request(f"reasoning.{key} must be a string")
    return extra


def seal_reasoning(text: str) -> str:
    """The reasoning text as our `encrypted_content`: opaque to the harness, exact for us."""
    return _SEALED_PREFIX + base64.urlsafe_b64encode(text.encode()).decode()


def unseal_reasoning(sealed: str) -> str | None:
    """The text `seal_reasoning` wrote; None for anything else (e.g. real OpenAI encrypted content)."""
    if not sealed.startswith(_SEALED_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(sealed[len(_SEALED_PREFIX) :].encode()).decode()
    except (binascii.Error, ValueError):
        return None


# ---- encoding helpers --------------------------------------------------------------------------------------


def _response(conv: Conversation, completion: Completion, core: str) -> dict[str, Any]:
    extra = conv.extra
    incomplete = completion.finish_reason == "length"
    now = int(time.time())
    reasoning = extra.get("reasoning", {})
    verbosity = extra.get("text", {}).get("verbosity")
    return {
        "id": "resp_" + core,
        "object": "response",
        "created_at": now,
        "status": "incomplete" if incomplete else "completed",
        "background": False,
        "completed_at": None if incomplete else now,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": extra.get("instructions"),
        "max_output_tokens": conv.max_tokens,
        "max_tool_calls": None,
        "model": conv.model or completion.model,
        "output": _output_items(conv, completion, core),
        "parallel_tool_calls": extra.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "prompt_cache_key": extra.get("prompt_cache_key"),
        "reasoning": {
            "effort": _known(reasoning.get("effort"), _EFFORTS),
            "summary": _known(reasoning.get("summary"), _SUMMARIES),
        },
        "store": extra.get("store", False),  # nothing is ever stored here
        "temperature": conv.temperature if conv.temperature is not None else 1.0,
        # Plain text whatever format was asked: the engine's output is not schema-constrained.
        "text": {"format": {"type": "text"}, "verbosity": _known(verbosity, _VERBOSITIES)},
        "tool_choice": _tool_choice_echo(conv),
        "tools": extra.get("tools", []),
        "top_p": conv.top_p if conv.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": _usage(completion),
        "user": extra.get("user"),
        "metadata": extra.get("metadata", {}),
    }


def _known(value: Any, known: tuple[str, ...]) -> str | None:
    return value if value in known else None


def _tool_choice_echo(conv: Conversation) -> str | dict[str, Any]:
    choice = conv.tool_choice
    if isinstance(choice, dict):
        kind = "custom" if choice["name"] in conv.extra.get("custom_tools", []) else "function"
        return {"type": kind, "name": choice["name"]}
    return choice or "auto"


def compaction_item(completion: Completion, core: str) -> dict[str, Any]:
    """The answer to a compaction request: the summary the engine sampled, sealed as the compaction's content."""
    summary = completion.content or completion.reasoning or ""
    return {"id": f"cmp_{core}", "type": "compaction", "encrypted_content": seal_reasoning(summary)}


def _output_items(conv: Conversation, completion: Completion, core: str) -> list[dict[str, Any]]:
    """Reasoning, then the message, then the tool calls: the order the model wrote them (a compaction request:
    the compaction item alone)."""
    if conv.compaction:
        return [compaction_item(completion, core)]
    items: list[dict[str, Any]] = []
    if completion.reasoning:
        reasoning: dict[str, Any] = {
            "id": f"rs_{core}",
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": completion.reasoning}],
        }
        if "reasoning.encrypted_content" in conv.extra.get("include", []):
            reasoning["encrypted_content"] = seal_reasoning(completion.reasoning)
        items.append(reasoning)
    if completion.content or not completion.tool_calls:
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        items.append(
            {
                "id": f"msg_{core}",
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [_output_text_part(completion.content)],
            }
        )
    custom_names = set(conv.extra.get("custom_tools", []))
    for index, call in enumerate(completion.tool_calls):
        call_id = call.id or f"call_{core}_{index}"
        if call.name in custom_names:
            items.append(
                {
                    "id": f"ctc_{core}_{index}",
                    "type": "custom_tool_call",
                    "call_id": call_id,
                    "name": call.name,
                    "input": _custom_input(call),
                }
            )
        else:
            items.append(
                {
                    "id": f"fc_{core}_{index}",
                    "type": "function_call",
                    "call_id": call_id,
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": "completed",
                }
            )
    return items


def _output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _custom_input(call: ToolCall) -> str:
    """The free-form text of a custom tool call: its `input` argument, else the raw arguments text."""
    arguments = call.arguments_obj()
    if isinstance(arguments, dict) and isinstance(arguments.get("input"), str):
        return arguments["input"]
    return call.arguments


def _usage(completion: Completion) -> dict[str, Any]:
    cached = completion.meta_info.get("cached_tokens")
    return {
        "input_tokens": completion.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached if isinstance(cached, int) else 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": completion.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


# ---- the event stream --------------------------------------------------------------------------------------


class _EventCounter:
    """Numbers events: every Responses stream event carries an increasing `sequence_number`."""

    def __init__(self) -> None:
        self.next_number = 0

    def emit(self, event_type: str, **fields: Any) -> bytes:
        payload = {"type": event_type, "sequence_number": self.next_number, **fields}
        self.next_number += 1
        return sse_event(payload, event=event_type)


def _stream_reasoning(events: _EventCounter, index: int, item: dict[str, Any]) -> Iterator[bytes]:
    yield events.emit("response.output_item.added", output_index=index, item={**item, "summary": []})
    ids = {"item_id": item["id"], "output_index": index}
    for summary_index, part in enumerate(item["summary"]):
        yield events.emit(
            "response.reasoning_summary_part.added",
            **ids,
            summary_index=summary_index,
            part={"type": "summary_text", "text": ""},
        )
        for piece in stream_pieces(part["text"], DELTA_CHARS):
            yield events.emit(
                "response.reasoning_summary_text.delta", **ids, summary_index=summary_index, delta=piece
            )
        yield events.emit(
            "response.reasoning_summary_text.done", **ids, summary_index=summary_index, text=part["text"]
        )
        yield events.emit(
            "response.reasoning_summary_part.done", **ids, summary_index=summary_index, part=part
        )
    yield events.emit("response.output_item.done", output_index=index, item=item)


def _stream_message(events: _EventCounter, index: int, item: dict[str, Any]) -> Iterator[bytes]:
    yield events.emit(
        "response.output_item.added",
        output_index=index,
        item={**item, "status": "in_progress", "content": []},
    )
    ids = {"item_id": item["id"], "output_index": index}
    for content_index, part in enumerate(item["content"]):
        yield events.emit(
            "response.content_part.added", **ids, content_index=content_index, part=_output_text_part("")
        )
        for piece in stream_pieces(part["text"], DELTA_CHARS):
            yield events.emit(
                "response.output_text.delta", **ids, content_index=content_index, delta=piece, logprobs=[]
            )
        yield events.emit(
            "response.output_text.done", **ids, content_index=content_index, text=part["text"], logprobs=[]
        )
        yield events.emit("response.content_part.done", **ids, content_index=content_index, part=part)
    yield events.emit("response.output_item.done", output_index=index, item=item)


def _stream_function_call(events: _EventCounter, index: int, item: dict[str, Any]) -> Iterator[bytes]:
    yield events.emit(
        "response.output_item.added",
        output_index=index,
        item={**item, "arguments": "", "status": "in_progress"},
    )
    ids = {"item_id": item["id"], "output_index": index}
    for piece in stream_pieces(item["arguments"], DELTA_CHARS):
        yield events.emit("response.function_call_arguments.delta", **ids, delta=piece)
    yield events.emit("response.function_call_arguments.done", **ids, arguments=item["arguments"])
    yield events.emit("response.output_item.done", output_index=index, item=item)


def _stream_custom_tool_call(events: _EventCounter, index: int, item: dict[str, Any]) -> Iterator[bytes]:
    yield events.emit("response.output_item.added", output_index=index, item={**item, "input": ""})
    ids = {"item_id": item["id"], "output_index": index}
    for piece in stream_pieces(item["input"], DELTA_CHARS):
        yield events.emit("response.custom_tool_call_input.delta", **ids, delta=piece)
    yield events.emit("response.custom_tool_call_input.done", **ids, input=item["input"])
    yield events.emit("response.output_item.done", output_index=index, item=item)


def compaction_added(events: _EventCounter, index: int, item_id: str) -> bytes:
    """A compaction item opens empty: its sealed summary comes only with output_item.done."""
    return events.emit(
        "response.output_item.added",
        output_index=index,
        item={"id": item_id, "type": "compaction", "encrypted_content": ""},
    )


def compaction_compacting(events: _EventCounter, index: int, item_id: str) -> bytes:
    """Summary content was sampled (the event carries none of it)."""
    return events.emit("response.compaction.compacting", item_id=item_id, output_index=index)


def _stream_compaction(events: _EventCounter, index: int, item: dict[str, Any]) -> Iterator[bytes]:
    yield compaction_added(events, index, item["id"])
    yield compaction_compacting(events, index, item["id"])
    yield events.emit("response.output_item.done", output_index=index, item=item)


_ITEM_STREAMS = {
    "reasoning": _stream_reasoning,
    "message": _stream_message,
    "function_call": _stream_function_call,
    "custom_tool_call": _stream_custom_tool_call,
    "compaction": _stream_compaction,
}
