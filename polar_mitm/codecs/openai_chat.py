"""OpenAI Chat Completions (`POST …/chat/completions`): Qwen Code, opencode, Pi and most OpenAI-compatible
clients.

The request is close to the engine's own format, so decoding is mostly validation; answers are a
`ChatCompletion` or its `chat.completion.chunk` stream ending in `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from polar_mitm.codecs import structured
from polar_mitm.codecs.common import (
    INT64_MAX,
    SSE_DONE,
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
    parse_stop,
    thinking_from_effort,
)
from polar_mitm.conversation import Completion, Conversation, Message, Tool, ToolCall

# Request fields with no engine meaning, kept for the record (and for echoes).
_EXTRA_KEYS = (
    "metadata",
    "user",
    "n",
    "parallel_tool_calls",
    "seed",
    "response_format",
    "service_tier",
    "store",
    "logprobs",
    "top_logprobs",
    "prompt_cache_key",
)
_UNSUPPORTED_PARTS = ("image_url", "input_audio", "file", "image", "audio")


class OpenAIChatCodec(OpenAICodec):
    """Chat Completions ⇄ Conversation: `…/chat/completions` under any prefix (`/v1`, `/api/v1`, `/s/SESSION/v1`,
    none)."""

    name = "openai_chat"
    # OpenAI's own, and the OpenAI-compatible providers harnesses are pointed at (Qwen's DashScope, OpenRouter).
    hosts = ("api.openai.com", "dashscope.aliyuncs.com", "openrouter.ai")
    call_path = "/chat/completions"

    # ---- request -------------------------------------------------------------------------------------------

    def decode_request(self, body: Any, path: str, query: dict[str, str]) -> Conversation:
        """A Chat Completions body → Conversation; GatewayError("invalid_request") on anything malformed."""
        body = require_dict(body, "request body")
        messages = _decode_messages(require_list(body.get("messages"), "messages"))
        if not messages:
            raise invalid_request("messages must not be empty")
        n = optional_int(body, "n", minimum=1)
        if n is not None and n > 1:
            raise invalid_request("n>1 not supported: ask for one choice per request")
        stream_options = optional_dict(body, "stream_options") or {}
        max_tokens = optional_int(body, "max_completion_tokens", minimum=1, maximum=INT64_MAX)
        if max_tokens is None:
            max_tokens = optional_int(body, "max_tokens", minimum=1, maximum=INT64_MAX)
        return Conversation(
            messages=messages,
            model=optional_str(body, "model") or "",
            tools=_decode_tools(body),
            tool_choice=_decode_tool_choice(body.get("tool_choice")),
            max_tokens=max_tokens,
            temperature=optional_number(body, "temperature"),
            top_p=optional_number(body, "top_p"),
            top_k=optional_int(body, "top_k", minimum=-1),
            stop=parse_stop(body.get("stop")),
            stream=bool(optional_bool(body, "stream")),
            thinking=_decode_thinking(body),
            include_usage=bool(optional_bool(stream_options, "include_usage")),
            response_format=structured.from_openai_chat(body.get("response_format")),
            extra={key: body[key] for key in _EXTRA_KEYS if body.get(key) is not None},
        )

    # ---- answers -------------------------------------------------------------------------------------------

    def encode_response(self, conv: Conversation, completion: Completion) -> dict[str, Any]:
        """A `ChatCompletion` with one choice; `model` is the name the harness asked for."""
        message: dict[str, Any] = {"role": "assistant", "content": _content(completion), "refusal": None}
        if completion.reasoning:
            message["reasoning_content"] = completion.reasoning
        if completion.tool_calls:
            message["tool_calls"] = [_tool_call_json(call, i) for i, call in enumerate(completion.tool_calls)]
        return {
            **_head(conv, completion),
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": _finish_reason(completion),
                }
            ],
            "usage": _usage(completion),
        }

    def encode_stream(self, conv: Conversation, completion: Completion) -> Iterator[bytes]:
        """The `chat.completion.chunk` replay of a finished completion, then `data: [DONE]`."""
        head = {**_head(conv, completion), "object": "chat.completion.chunk"}
        if conv.include_usage:
            head["usage"] = None  # OpenAI sends `usage: null` on every chunk before the usage chunk

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return sse_event({**head, "choices": [choice]})

        yield chunk({"role": "assistant", "content": ""})
        for piece in stream_pieces(completion.reasoning or "", DELTA_CHARS):
            yield chunk({"reasoning_content": piece})
        for piece in stream_pieces(completion.content, DELTA_CHARS):
            yield chunk({"content": piece})
        for index, call in enumerate(completion.tool_calls):
            first = _tool_call_json(call, index)
            first["function"]["arguments"] = ""
            yield chunk({"tool_calls": [{"index": index, **first}]})
            for piece in stream_pieces(call.arguments, DELTA_CHARS):
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        yield chunk({}, _finish_reason(completion))
        if conv.include_usage:
            yield sse_event({**head, "choices": [], "usage": _usage(completion)})
        yield SSE_DONE


# ---- decoding helpers --------------------------------------------------------------------------------------


def _decode_messages(raw: list[Any]) -> list[Message]:
    messages: list[Message] = []
    legacy_call_ids: dict[str, str] = {}  # legacy `function_call` name → the id given to it
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        msg = require_dict(item, where)
        role = msg.get("role")
        if role in ("system", "developer"):
            messages.append(Message(role="system", content=_text(msg.get("content"), f"{where}.content")))
        elif role == "user":
            messages.append(Message(role="user", content=_text(msg.get("content"), f"{where}.content")))
        elif role == "assistant":
            messages.append(_decode_assistant(msg, i, legacy_call_ids))
        elif role == "tool":
            messages.append(
                Message(
                    role="tool",
                    content=_text(msg.get("content"), f"{where}.content"),
                    tool_call_id=optional_str(msg, "tool_call_id", f"{where}."),
                    name=optional_str(msg, "name", f"{where}."),
                )
            )
        elif role == "function":  # legacy function result: matched to its call by name
            name = require_str(msg.get("name"), f"{where}.name")
            messages.append(
                Message(
                    role="tool",
                    content=_text(msg.get("content"), f"{where}.content"),
                    tool_call_id=legacy_call_ids.get(name),
                    name=name,
                )
            )
        else:
            raise invalid_request(f"{where}.role must be one of system, developer, user, assistant, tool")
    return messages


def _decode_assistant(msg: dict[str, Any], index: int, legacy_call_ids: dict[str, str]) -> Message:
    where = f"messages[{index}]"
    raw_calls = msg.get("tool_calls") or []
    calls = [
        _decode_tool_call(call, f"{where}.tool_calls[{j}]", f"call_{index}_{j}")
        for j, call in enumerate(require_list(raw_calls, f"{where}.tool_calls"))
    ]
    legacy = msg.get("function_call")
    if legacy is not None:
        function = require_dict(legacy, f"{where}.function_call")
        call = ToolCall(
            id=f"call_{index}",
            name=require_str(function.get("name"), f"{where}.function_call.name"),
            arguments=arguments_text(function.get("arguments"), f"{where}.function_call.arguments"),
        )
        legacy_call_ids[call.name] = call.id
        calls.append(call)
    # Reasoning sent back by the harness: `reasoning_content` (SGLang, DeepSeek) or `reasoning` (OpenRouter).
    candidates = (msg.get("reasoning_content"), msg.get("reasoning"))
    reasoning = next((r for r in candidates if isinstance(r, str) and r), None)
    return Message(
        role="assistant",
        content=_text(msg.get("content"), f"{where}.content"),
        reasoning=reasoning,
        tool_calls=calls,
    )


def _decode_tool_call(raw: Any, where: str, fallback_id: str) -> ToolCall:
    call = require_dict(raw, where)
    call_id = optional_str(call, "id", f"{where}.") or fallback_id
    if call.get("type") == "custom":  # a custom (free-form) tool call: its text becomes the `input` argument
        custom = require_dict(call.get("custom"), f"{where}.custom")
        input_text = require_str(custom.get("input", ""), f"{where}.custom.input")
        return ToolCall(
            id=call_id,
            name=require_str(custom.get("name"), f"{where}.custom.name"),
            arguments=custom_tool_arguments(input_text),
        )
    function = require_dict(call.get("function"), f"{where}.function")
    return ToolCall(
        id=call_id,
        name=require_str(function.get("name"), f"{where}.function.name"),
        arguments=arguments_text(function.get("arguments"), f"{where}.function.arguments"),
    )


def _text(content: Any, where: str) -> str:
    """Message content: a string, null, or a list of parts whose text parts are concatenated."""
    return content_text(content, where, ("text",), _UNSUPPORTED_PARTS)


def _decode_tools(body: dict[str, Any]) -> list[Tool]:
    if body.get("tools") is None and body.get("functions") is not None:  # legacy `functions`
        return [
            _decode_function(fn, f"functions[{j}]")
            for j, fn in enumerate(require_list(body["functions"], "functions"))
        ]
    tools = []
    for j, raw in enumerate(require_list(body.get("tools") or [], "tools")):
        where = f"tools[{j}]"
        tool = require_dict(raw, where)
        kind = tool.get("type", "function")
        if kind == "function":
            tools.append(_decode_function(tool.get("function"), f"{where}.function"))
        elif kind == "custom":
            custom = require_dict(tool.get("custom"), f"{where}.custom")
            tools.append(
                Tool(
                    name=require_str(custom.get("name"), f"{where}.custom.name"),
                    description=optional_str(custom, "description", f"{where}.custom.") or "",
                    parameters=custom_tool_parameters(custom.get("format")),
                )
            )
        # other tool kinds are hosted by OpenAI: nothing a local model can call
    return tools


def _decode_function(raw: Any, where: str) -> Tool:
    function = require_dict(raw, where)
    name = require_str(function.get("name"), f"{where}.name")
    if not name:
        raise invalid_request(f"{where}.name must not be empty")
    parameters = optional_dict(function, "parameters", f"{where}.")
    return Tool(
        name=name,
        description=optional_str(function, "description", f"{where}.") or "",
        parameters=parameters if parameters is not None else {"type": "object", "properties": {}},
    )


def _decode_tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise invalid_request("tool_choice must be auto, none, required or a named function")
        return value
    choice = require_dict(value, "tool_choice")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        named = require_dict(choice.get(kind), f"tool_choice.{kind}")
        return {"name": require_str(named.get("name"), f"tool_choice.{kind}.name")}
    if kind == "allowed_tools":
        mode = require_dict(choice.get("allowed_tools"), "tool_choice.allowed_tools").get("mode")
        if mode not in ("auto", "required"):
            raise invalid_request("tool_choice.allowed_tools.mode must be auto or required")
        return mode
    raise invalid_request("tool_choice.type must be function, custom or allowed_tools")


def _decode_thinking(body: dict[str, Any]) -> bool | None:
    """`reasoning_effort` (OpenAI), else the SGLang/vLLM `chat_template_kwargs.enable_thinking`, else Qwen's
    top-level `enable_thinking`."""
    if body.get("reasoning_effort") is not None:
        return thinking_from_effort(body["reasoning_effort"], "reasoning_effort")
    kwargs = optional_dict(body, "chat_template_kwargs") or {}
    if isinstance(kwargs.get("enable_thinking"), bool):
        return kwargs["enable_thinking"]
    return optional_bool(body, "enable_thinking")


# ---- encoding helpers --------------------------------------------------------------------------------------


def _head(conv: Conversation, completion: Completion) -> dict[str, Any]:
    # The weight version is exactly what `system_fingerprint` means: which backend state produced the answer.
    return {
        "id": "chatcmpl-" + id_core(completion.id),
        "created": int(time.time()),
        "model": conv.model or completion.model,
        "system_fingerprint": completion.weight_version,
    }


def _content(completion: Completion) -> str | None:
    if completion.tool_calls and not completion.content:
        return None
    return completion.content


def _tool_call_json(call: ToolCall, index: int) -> dict[str, Any]:
    return {
        "id": call.id or f"call_{index}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _finish_reason(completion: Completion) -> str:
    if completion.finish_reason in ("length", "tool_calls"):
        return completion.finish_reason
    return "tool_calls" if completion.tool_calls else "stop"  # abort/error have no OpenAI name


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }
