"""Anthropic Messages API (`POST …/v1/messages`): decode a request, encode a `Message` or its SSE stream.

Also answers Anthropic's auxiliary endpoints locally: `…/v1/messages/count_tokens` and `GET …/v1/models[/{id}]`.
Shapes follow the official SDK's types (`anthropic.types.Message`, `RawMessageStreamEvent`, `ModelInfo`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar
from urllib.parse import unquote

from polar_mitm.codecs import structured
from polar_mitm.codecs.base import ERROR_STATUS, Codec, GatewayError, HttpAnswer
from polar_mitm.codecs.common import (
    INT32_MAX,
    INT64_MAX,
    check_int_range,
    expect,
    invalid_request,
    sse_event,
    stream_pieces,
)
from polar_mitm.conversation import Completion, Conversation, Message, Tool, ToolCall

# Claude Code's per-request billing line (`x-anthropic-billing-header: cc_version=…; cch=<hash>;`). It changes every
# request, so left in the system prompt it would break the token prefix shared by consecutive turns.
_BILLING_LINE = re.compile(r"^[ \t]*x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE | re.IGNORECASE)

# Blocks of Anthropic-executed (server) tools: the engine cannot run them, and they carry nothing it could use.
_IGNORED_BLOCKS = frozenset(
    {
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "container_upload",
    }
)
_MEDIA_BLOCKS = frozenset({"image", "document"})

_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}

_STOP_REASON = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "abort": "end_turn",
    "error": "end_turn",
}

# Anthropic's error type follows the HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    431: "request_too_large",  # the API has no type of its own for a head too large
    500: "api_error",
    529: "overloaded_error",
}
_EXPECTED = "{where}: expected {what}, got {got}"  # Anthropic's wording of a wrongly typed field

_STREAM_CHUNK_CHARS = 16
_MODEL_CREATED_AT = "1970-01-01T00:00:00Z"  # the API's own convention for an unknown release date
_MODELS_PATH = re.compile(r"(?:^|/)v1/models(?:/(?P<model_id>[^/]+))?$")


class AnthropicCodec(Codec):
    """The Anthropic Messages API, as Claude Code and the Anthropic SDKs speak it."""

    name: ClassVar[str] = "anthropic"
    hosts: ClassVar[tuple[str, ...]] = ("api.anthropic.com",)
    error_status: ClassVar[dict[str, int]] = {**ERROR_STATUS, "overloaded": 529, "engine_error": 500}

    # -- routing --------------------------------------------------------------------------------------------------

    def matches(self, path: str) -> bool:
        """Any `…/v1/messages` (prefixes such as `/s/SESSION` or `/anthropic` are allowed), not count_tokens."""
        return path.rstrip("/").endswith("/v1/messages")

    def count_tokens_path(self, path: str) -> bool:
        """Any `…/v1/messages/count_tokens`."""
        return path.rstrip("/").endswith("/v1/messages/count_tokens")

    def models_path(self, path: str, method: str) -> bool:
        """`GET …/v1/models` (list) or `GET …/v1/models/{id}` (one model)."""
        return method.upper() == "GET" and _MODELS_PATH.search(path.rstrip("/")) is not None

    # -- requests -------------------------------------------------------------------------------------------------

    def decode_request(self, body: Any, path: str, query: dict[str, str]) -> Conversation:
        """A Messages request → Conversation. Raises GatewayError("invalid_request") on any malformed input."""
        return _decode(body, require_max_tokens=True)

    def decode_count_tokens(self, body: Any, path: str, query: dict[str, str]) -> Conversation:
        """A count_tokens request: a Messages request without `max_tokens`."""
        return _decode(body, require_max_tokens=False)

    # -- responses ------------------------------------------------------------------------------------------------

    def encode_response(self, conv: Conversation, completion: Completion) -> dict[str, Any]:
        """The non-streaming `Message`."""
        message = _message_head(conv, completion)
        message["content"] = _content_blocks(completion)
        message["stop_reason"], message["stop_sequence"] = _stop_reason(conv, completion)
        return message

    def encode_stream(self, conv: Conversation, completion: Completion) -> Iterator[bytes]:
        """message_start, ping, each content block (start, deltas, stop), message_delta, message_stop."""
        start = _message_head(conv, completion)
        start["usage"]["output_tokens"] = min(
            1, completion.completion_tokens
        )  # as the API does before sampling
        yield sse_event({"type": "message_start", "message": start}, event="message_start")
        yield sse_event({"type": "ping"}, event="ping")
        for index, block in enumerate(_content_blocks(completion)):
            for event in _block_events(index, block):
                yield sse_event(event, event=event["type"])
        stop_reason, stop_sequence = _stop_reason(conv, completion)
        yield sse_event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": _usage(completion),
            },
            event="message_delta",
        )
        yield sse_event({"type": "message_stop"}, event="message_stop")

    def encode_error(self, error: GatewayError) -> HttpAnswer:
        """`{"type": "error", "error": {"type", "message"}, "request_id"}` with the API's status for the kind."""
        status = self.status_for(error)
        error_type = _ERROR_TYPES.get(status, "api_error")
        # Claude Code compacts and retries on exactly this wording: /^prompt is too long: \d+ tokens > \d+ maximum$/
        message = error.worded("prompt is too long: {n} tokens > {limit} maximum")
        payload = {
            "type": "error",
            "error": {"type": error_type, "message": message},
            "request_id": f"req_{uuid.uuid4().hex}",
        }
        return HttpAnswer.json(status, payload)

    # -- auxiliary endpoints --------------------------------------------------------------------------------------

    def encode_count_tokens(self, n_tokens: int) -> dict[str, Any]:
        """The count_tokens answer."""
        return {"input_tokens": n_tokens}

    def encode_models(self, model_ids: list[str], path: str) -> dict[str, Any]:
        """A model list page, or one model for `…/v1/models/{id}`.

        A lookup answers for any id: the gateway serves whatever model name the harness is configured with.
        """
        found = _MODELS_PATH.search(path.rstrip("/"))
        if found is not None and found.group("model_id"):
            return _model_info(unquote(found.group("model_id")))
        return {
            "data": [_model_info(model_id) for model_id in model_ids],
            "has_more": False,
            "first_id": model_ids[0] if model_ids else None,
            "last_id": model_ids[-1] if model_ids else None,
        }


# -- decoding ---------------------------------------------------------------------------------------------------------


def _expect(value: Any, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    """`value` if it is a `kind`, else an invalid_request error naming `where`. JSON booleans are not numbers."""
    return expect(value, kind, where, what, _EXPECTED)


def _optional(body: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    return None if value is None else _expect(value, kind, key, what)


def _decode(body: Any, *, require_max_tokens: bool) -> Conversation:
    body = _expect(body, dict, "body", "a JSON object")
    raw_messages = _expect(body.get("messages"), list, "messages", "a list")
    if not raw_messages:
        raise invalid_request("messages: at least one message is required")
    max_tokens = _optional(body, "max_tokens", int, "an integer")
    if max_tokens is None and require_max_tokens:
        raise invalid_request("max_tokens: field required")
    if max_tokens is not None:
        check_int_range(max_tokens, "max_tokens", 1, INT64_MAX)
    top_k = _optional(body, "top_k", int, "an integer")
    if top_k is not None:
        check_int_range(top_k, "top_k", 0, INT32_MAX)
    metadata = _optional(body, "metadata", dict, "an object")

    messages = _decode_system(body.get("system"))
    tool_names: dict[str, str] = {}  # tool_use id → tool name, to name the results that answer them
    loaded: set[str] = set()  # deferred tools the conversation has loaded (tool_reference blocks)
    for i, raw in enumerate(raw_messages):
        messages.extend(_decode_message(raw, f"messages.{i}", tool_names, loaded))
    loaded.update(tool_names.values())  # a tool the model already called was loaded before that call
    tools = _decode_tools(body.get("tools"), loaded)
    tool_choice = _decode_tool_choice(body.get("tool_choice"))
    return Conversation(
        messages=messages,
        model=_optional(body, "model", str, "a string") or "",
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        top_k=top_k,
        stop=_decode_stop_sequences(body.get("stop_sequences")),
        stream=bool(_optional(body, "stream", bool, "a boolean")),
        thinking=_decode_thinking(body.get("thinking")),
        response_format=structured.from_anthropic(body),
        extra={} if metadata is None else {"metadata": metadata},
    )


def _number(body: dict[str, Any], key: str) -> float | None:
    value = _optional(body, key, (int, float), "a number")
    if value is None:
        return None
    try:
        number = float(value)
    except OverflowError:  # a huge JSON integer
        number = math.inf
    if not math.isfinite(number):
        raise invalid_request(f"{key}: must be a finite number")
    return number


def _decode_stop_sequences(value: Any) -> list[str]:
    if value is None:
        return []
    sequences = _expect(value, list, "stop_sequences", "a list of strings")
    return [_expect(s, str, f"stop_sequences.{i}", "a string") for i, s in enumerate(sequences)]


def _decode_thinking(value: Any) -> bool | None:
    if value is None:
        return None
    config = _expect(value, dict, "thinking", "an object")
    kind = config.get("type")
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    raise invalid_request(f"thinking.type: expected 'enabled', 'adaptive' or 'disabled', got {kind!r}")


def _decode_system(value: Any) -> list[Message]:
    """The system prompt as one system message (none when absent or empty), billing lines removed."""
    if value is None:
        return []
    if isinstance(value, str):
        texts = [value]
    else:
        blocks = _expect(value, list, "system", "a string or a list of text blocks")
        texts = [_text_block(block, f"system.{i}") for i, block in enumerate(blocks)]
    kept = []
    for text in texts:
        cleaned = _BILLING_LINE.sub("", text)
        if cleaned.strip() or cleaned == text:  # drop a block only when it held nothing but the billing line
            kept.append(cleaned)
    system = "\n".join(kept)
    return [Message(role="system", content=system)] if system else []


def _text_block(block: Any, where: str) -> str:
    block = _expect(block, dict, where, "a content block object")
    if block.get("type") != "text":
        raise invalid_request(f"{where}.type: expected 'text', got {block.get('type')!r}")
    return _expect(block.get("text"), str, f"{where}.text", "a string")


def _block_type(block: Any, where: str) -> str:
    block = _expect(block, dict, where, "a content block object")
    kind = _expect(block.get("type"), str, f"{where}.type", "a string")
    if kind in _MEDIA_BLOCKS:
        raise invalid_request(f"{where}: {kind} blocks (images, documents) are not supported by this gateway")
    return kind


def _decode_message(raw: Any, where: str, tool_names: dict[str, str], loaded: set[str]) -> list[Message]:
    raw = _expect(raw, dict, where, "a message object")
    role = raw.get("role")
    if role not in ("user", "assistant", "system"):
        raise invalid_request(f"{where}.role: expected 'user', 'assistant' or 'system', got {role!r}")
    content = raw.get("content")
    if role == "system":
        # Claude Code ≥ 2.1 sends mid-conversation system messages (environment, per-turn settings) in
        # `messages`; they are system turns to the model, so they stay system turns for the engine.
        return _decode_mid_system(content, where)
    if isinstance(content, str):
        return [Message(role=role, content=content)]
    blocks = _expect(content, list, f"{where}.content", "a string or a list of content blocks")
    if role == "assistant":
        return [_decode_assistant(blocks, where, tool_names)]
    return _decode_user(blocks, where, tool_names, loaded)


def _decode_mid_system(content: Any, where: str) -> list[Message]:
    """A `role: "system"` message inside `messages`: text only, billing lines removed like the top-level system."""
    if isinstance(content, str):
        texts = [content]
    else:
        blocks = _expect(content, list, f"{where}.content", "a string or a list of text blocks")
        texts = [_text_block(block, f"{where}.content.{i}") for i, block in enumerate(blocks)]
    return [Message(role="system", content=_BILLING_LINE.sub("", "\n".join(texts)))]


def _decode_assistant(blocks: list[Any], where: str, tool_names: dict[str, str]) -> Message:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for i, block in enumerate(blocks):
        at = f"{where}.content.{i}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_expect(block.get("text"), str, f"{at}.text", "a string"))
        elif kind == "thinking":
            thoughts.append(_expect(block.get("thinking"), str, f"{at}.thinking", "a string"))
        elif kind == "tool_use":
            call = _decode_tool_use(block, at)
            tool_names[call.id] = call.name
            calls.append(call)
        elif kind not in _IGNORED_BLOCKS:
            raise invalid_request(f"{at}.type: unsupported assistant content block {kind!r}")
    return Message(
        role="assistant", content="\n".join(texts), reasoning="\n".join(thoughts) or None, tool_calls=calls
    )


def _decode_tool_use(block: dict[str, Any], where: str) -> ToolCall:
    call_id = _expect(block.get("id"), str, f"{where}.id", "a string")
    name = _expect(block.get("name"), str, f"{where}.name", "a string")
    tool_input = block.get("input")
    tool_input = {} if tool_input is None else _expect(tool_input, dict, f"{where}.input", "an object")
    return ToolCall(id=call_id, name=name, arguments=json.dumps(tool_input, ensure_ascii=False))


def _decode_user(
    blocks: list[Any], where: str, tool_names: dict[str, str], loaded: set[str]
) -> list[Message]:
    """Tool results first (each its own tool message, in order), then the user's text as one user message.

    Chat templates expect tool results right after the assistant turn that called the tools.
    """
    results: list[Message] = []
    texts: list[str] = []
    for i, block in enumerate(blocks):
        at = f"{where}.content.{i}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_expect(block.get("text"), str, f"{at}.text", "a string"))
        elif kind == "tool_result":
            results.append(_decode_tool_result(block, at, tool_names, loaded))
        elif kind not in _IGNORED_BLOCKS:
            raise invalid_request(f"{at}.type: unsupported user content block {kind!r}")
    if texts or not results:
        return [*results, Message(role="user", content="\n".join(texts))]
    return results


def _decode_tool_result(
    block: dict[str, Any], where: str, tool_names: dict[str, str], loaded: set[str]
) -> Message:
    call_id = _expect(block.get("tool_use_id"), str, f"{where}.tool_use_id", "a string")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = _expect(content, list, f"{where}.content", "a string or a list of content blocks")
        texts = []
        for i, part in enumerate(parts):
            at = f"{where}.content.{i}"
            if _block_type(part, at) == "tool_reference":  # also rejects images and documents
                # A tool search result: the API expands it into the referenced (deferred) tool's definition.
                loaded.add(_expect(part.get("tool_name"), str, f"{at}.tool_name", "a string"))
                continue
            texts.append(_text_block(part, at))
        text = "\n".join(texts)
    # is_error needs no marking: the harness already wrote the failure into the text the model should read.
    return Message(role="tool", content=text, tool_call_id=call_id, name=tool_names.get(call_id))


def _decode_tools(value: Any, loaded: set[str]) -> list[Tool]:
    """Client tools (those with an `input_schema`) the model can see.

    Anthropic-executed server tools are left out, and so are deferred tools (`defer_loading: true`, Claude Code's
    ToolSearch shape on the first-party host) until the conversation has loaded them: the API keeps their schemas
    out of the prompt until a tool search references them, and so must we.
    """
    if value is None:
        return []
    decoded = (
        _decode_tool(raw, f"tools.{i}", loaded)
        for i, raw in enumerate(_expect(value, list, "tools", "a list"))
    )
    return [tool for tool in decoded if tool is not None]


def _decode_tool(raw: Any, where: str, loaded: set[str]) -> Tool | None:
    raw = _expect(raw, dict, where, "a tool object")
    schema = raw.get("input_schema")
    if schema is None:  # a server tool (web_search_…, bash_…): Anthropic runs it, our engine cannot
        return None
    name = _expect(raw.get("name"), str, f"{where}.name", "a string")
    if raw.get("defer_loading") is True and name not in loaded:
        return None
    description = raw.get("description")
    return Tool(
        name=name,
        description=""
        if description is None
        else _expect(description, str, f"{where}.description", "a string"),
        parameters=_expect(schema, dict, f"{where}.input_schema", "an object"),
    )


def _decode_tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None:
        return None
    choice = _expect(value, dict, "tool_choice", "an object")
    kind = choice.get("type")
    if kind == "tool":
        return {"name": _expect(choice.get("name"), str, "tool_choice.name", "a string")}
    if isinstance(kind, str) and kind in _TOOL_CHOICE:
        return _TOOL_CHOICE[kind]
    raise invalid_request(f"tool_choice.type: expected 'auto', 'any', 'tool' or 'none', got {kind!r}")


# -- encoding ---------------------------------------------------------------------------------------------------------


def _message_head(conv: Conversation, completion: Completion) -> dict[str, Any]:
    """The Message fields shared by the JSON answer and the stream's message_start."""
    return {
        "id": _message_id(completion.id),
        "type": "message",
        "role": "assistant",
        "model": conv.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(completion),
    }


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "input_tokens": completion.prompt_tokens,
        "output_tokens": completion.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _anthropic_id(prefix: str, raw_id: str) -> str:
    """`raw_id` with Anthropic's prefix, keeping only id-safe characters (a fresh id when nothing is left)."""
    if raw_id.startswith(prefix):
        return raw_id
    tail = re.sub(r"[^A-Za-z0-9_]", "", raw_id)
    return prefix + (tail or uuid.uuid4().hex)


def _message_id(completion_id: str) -> str:
    return _anthropic_id("msg_", completion_id.removeprefix("chatcmpl-"))


def _signature(thinking: str) -> str:
    """An opaque signature for a thinking block; harnesses send it back and we never check it."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _tool_input(call: ToolCall) -> dict[str, Any]:
    """Anthropic tool input must be an object: anything else the model wrote is kept raw."""
    parsed = call.arguments_obj()
    return parsed if isinstance(parsed, dict) else {"_raw": call.arguments}


def _content_blocks(completion: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if completion.reasoning:
        blocks.append(
            {
                "type": "thinking",
                "thinking": completion.reasoning,
                "signature": _signature(completion.reasoning),
            }
        )
    if completion.content:
        blocks.append({"type": "text", "text": completion.content})
    for call in completion.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": _anthropic_id("toolu_", call.id),
                "name": call.name,
                "input": _tool_input(call),
            }
        )
    return blocks or [{"type": "text", "text": ""}]


def _stop_reason(conv: Conversation, completion: Completion) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). A stop on one of the request's stop_sequences is reported as such."""
    if completion.tool_calls:
        return "tool_use", None
    if completion.finish_reason == "stop":
        finish = completion.meta_info.get("finish_reason")
        matched = finish.get("matched") if isinstance(finish, dict) else None
        if isinstance(matched, str) and matched in conv.stop:
            return "stop_sequence", matched
    return _STOP_REASON.get(completion.finish_reason, "end_turn"), None


def _block_events(index: int, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """content_block_start, its deltas and content_block_stop for one finished content block."""
    kind = block["type"]
    if kind == "thinking":
        yield _block_start(index, {"type": "thinking", "thinking": "", "signature": ""})
        for piece in stream_pieces(block["thinking"], _STREAM_CHUNK_CHARS, at_whitespace=True):
            yield _block_delta(index, {"type": "thinking_delta", "thinking": piece})
        yield _block_delta(index, {"type": "signature_delta", "signature": block["signature"]})
    elif kind == "text":
        yield _block_start(index, {"type": "text", "text": ""})
        for piece in stream_pieces(block["text"], _STREAM_CHUNK_CHARS, at_whitespace=True):
            yield _block_delta(index, {"type": "text_delta", "text": piece})
    else:
        yield _block_start(index, {**block, "input": {}})
        arguments = json.dumps(block["input"], ensure_ascii=False)
        for piece in stream_pieces(arguments, _STREAM_CHUNK_CHARS):
            yield _block_delta(index, {"type": "input_json_delta", "partial_json": piece})
    yield {"type": "content_block_stop", "index": index}


def _block_start(index: int, content_block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": content_block}


def _block_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _model_info(model_id: str) -> dict[str, Any]:
    return {
        "type": "model",
        "id": model_id,
        "display_name": model_id,
        "created_at": _MODEL_CREATED_AT,
        "lifecycle": "active",
    }
