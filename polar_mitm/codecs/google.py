"""Google Gemini API codec: `models/{model}:generateContent` and `:streamGenerateContent` (SSE or JSON array).

The wire format is camelCase JSON (`functionCall`, `generationConfig`); some clients send the snake_case
spelling of the same fields, so every lookup accepts both. The model name comes from the path, not the body.
Function calls may come without ids: Gemini matches a result to its call by name, so decoding does the same.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from typing import Any, ClassVar
from urllib.parse import unquote

from polar_mitm.codecs import structured
from polar_mitm.codecs.base import ERROR_STATUS, Codec, GatewayError, HttpAnswer
from polar_mitm.codecs.common import (
    INT32_MAX,
    INT64_MAX,
    finite_number,
    integer,
    invalid_request,
    require_dict,
    require_list,
    require_str,
    sse_event,
    stream_pieces,
)
from polar_mitm.conversation import Completion, Conversation, FinishReason, Message, Tool, ToolCall

_MODEL = r"/(?P<model>(?:models|tunedModels)/[^/:]+)"
_CALL_PATH = re.compile(_MODEL + r":(?P<method>generateContent|streamGenerateContent)$")
_COUNT_PATH = re.compile(_MODEL + r":countTokens$")
_MODELS_PATH = re.compile(r"/models(?:/(?P<name>[^/:]+))?$")

# Google's canonical error status follows the HTTP code.
_ERROR_STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    413: "INVALID_ARGUMENT",
    431: "INVALID_ARGUMENT",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}
_FINISH: dict[FinishReason, str] = {
    "stop": "STOP",
    "tool_calls": "STOP",  # Gemini ends a function-calling turn with STOP, not a dedicated reason
    "length": "MAX_TOKENS",
    "abort": "OTHER",
    "error": "OTHER",
}
_TOOL_CHOICE = {
    "AUTO": "auto",
    "VALIDATED": "auto",
    "MODE_UNSPECIFIED": "auto",
    "ANY": "required",
    "NONE": "none",
}
_UNSUPPORTED_PARTS = ("inlineData", "fileData", "executableCode", "codeExecutionResult", "videoMetadata")
_MAX_SCHEMA_DEPTH = 64  # a deeper schema is abuse, and would otherwise end in a RecursionError
_STREAM_PIECE_CHARS = 80  # text is re-chunked for streaming; Gemini sends pieces of roughly this size


class GoogleCodec(Codec):
    """The Gemini API (as Gemini CLI and google-genai speak it)."""

    name: ClassVar[str] = "google"
    # The Gemini API, and Code Assist (Gemini CLI signed in with a Google account).
    hosts: ClassVar[tuple[str, ...]] = ("generativelanguage.googleapis.com", "cloudcode-pa.googleapis.com")
    error_status: ClassVar[dict[str, int]] = {**ERROR_STATUS, "engine_error": 500}
    # The engine's real limits are unknown here; harnesses such as Gemini CLI keep their own tables anyway.
    input_token_limit: ClassVar[int] = 1_048_576
    output_token_limit: ClassVar[int] = 65_536

    # --- model call -------------------------------------------------------------------------------------

    def matches(self, path: str) -> bool:
        """`…/models/{model}:generateContent` or `:streamGenerateContent`, under any prefix."""
        return _CALL_PATH.search(path) is not None

    def owns_path(self, path: str) -> bool:
        """A `…/models…` path with a method (`:countTokens`) or under `v1beta`: nobody else's API looks so."""
        return "/models" in path and (":" in path.rsplit("/", 1)[-1] or "v1beta" in path)

    def stream_requested(self, body: Any, path: str, query: dict[str, str]) -> bool:
        """Gemini streams by method (`:streamGenerateContent`), never by a body field."""
        found = _CALL_PATH.search(path)
        return found is not None and found["method"] == "streamGenerateContent"

    def decode_request(self, body: Any, path: str, query: dict[str, str]) -> Conversation:
        """A GenerateContentRequest → Conversation; `conv.extra["alt"]` is "sse" or "json" (array stream)."""
        request = require_dict(body, "request")
        found = _CALL_PATH.search(path)
        model = _model_name(found["model"] if found else _opt_str(request, "model"))
        conv = _decode_generate_request(request, model, require_contents=True)
        conv.stream = self.stream_requested(body, path, query)
        conv.extra["alt"] = "sse" if (query or {}).get("alt") == "sse" else "json"
        return conv

    def encode_response(self, conv: Conversation, completion: Completion) -> dict[str, Any]:
        """A GenerateContentResponse with one candidate."""
        parts = _reasoning_parts(conv, completion) + _text_parts(completion.content) + _call_parts(completion)
        return _chunk(conv, completion, parts or [{"text": ""}], final=True)

    def encode_stream(self, conv: Conversation, completion: Completion) -> Iterator[bytes]:
        """SSE `data:` frames, or a JSON array when the request had no `alt=sse` (the API's default)."""
        chunks = list(_stream_chunks(conv, completion))
        if conv.extra.get("alt") == "sse":
            yield from (sse_event(chunk) for chunk in chunks)
            return
        for i, chunk in enumerate(chunks):
            yield (b"[" if i == 0 else b",\r\n") + json.dumps(chunk, ensure_ascii=False).encode()
        yield b"]"

    def encode_error(self, error: GatewayError) -> HttpAnswer:
        """Google's `{"error": {"code", "message", "status"}}` with the matching HTTP status."""
        code = self.status_for(error)
        status = _ERROR_STATUS_NAMES.get(code, "INTERNAL")
        message = error.worded(
            "The input token count ({n}) exceeds the maximum number of tokens allowed ({limit})."
        )
        return HttpAnswer.json(code, {"error": {"code": code, "message": message, "status": status}})

    # --- auxiliary endpoints -----------------------------------------------------------------------------

    def count_tokens_path(self, path: str) -> bool:
        """`…/models/{model}:countTokens`."""
        return _COUNT_PATH.search(path) is not None

    def decode_count_tokens(self, body: Any, path: str, query: dict[str, str]) -> Conversation:
        """`{contents}` or `{generateContentRequest: {model, contents, systemInstruction, tools}}`."""
        request = require_dict(body, "request")
        found = _COUNT_PATH.search(path)
        model = _model_name(found["model"]) if found else ""
        inner = _get(request, "generateContentRequest")
        if inner is not None:
            inner = require_dict(inner, "generateContentRequest")
            return _decode_generate_request(
                inner, model or _model_name(_opt_str(inner, "model")), require_contents=False
            )
        return _decode_generate_request(
            {"contents": _get(request, "contents") or []}, model, require_contents=False
        )

    def encode_count_tokens(self, n_tokens: int) -> dict[str, Any]:
        """A CountTokensResponse."""
        return {"totalTokens": n_tokens}

    def models_path(self, path: str, method: str) -> bool:
        """GET `…/models` (list) or `…/models/{name}` (get); a path with a colon is a method call."""
        return method.upper() == "GET" and _MODELS_PATH.search(path) is not None

    def encode_models(self, model_ids: list[str], path: str) -> dict[str, Any]:
        """The model list, or one model for `…/models/{name}` (any name: the gateway answers every name)."""
        found = _MODELS_PATH.search(path)
        if found and found["name"]:
            return self._model_entry(unquote(found["name"]))
        return {"models": [self._model_entry(model_id) for model_id in model_ids]}

    def _model_entry(self, model_id: str) -> dict[str, Any]:
        return {
            "name": f"models/{model_id}",
            "baseModelId": model_id,
            "version": "001",
            "displayName": model_id,
            "inputTokenLimit": self.input_token_limit,
            "outputTokenLimit": self.output_token_limit,
            "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"],
        }


# --- decoding ------------------------------------------------------------------------------------------


@cache
def _snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def _get(obj: dict[str, Any], key: str) -> Any:
    """`obj[key]` under its camelCase name, else under its snake_case name."""
    value = obj.get(key)
    return obj.get(_snake(key)) if value is None else value


def _list(value: Any, where: str) -> list[Any]:
    return require_list(value, where, "a list")


def _opt_str(obj: Any, key: str) -> str | None:
    value = _get(obj, key) if isinstance(obj, dict) else None
    return None if value is None else require_str(value, key)


def _opt_number(obj: dict[str, Any], key: str) -> float | None:
    value = _get(obj, key)
    return None if value is None else finite_number(value, f"generationConfig.{key}")


def _opt_int(
    obj: dict[str, Any], key: str, minimum: int = -INT32_MAX, maximum: int = INT32_MAX
) -> int | None:
    """An integer field within [minimum, maximum] (`1e30` parses as a whole float: out of range, not a crash)."""
    value = _opt_number(obj, key)
    return None if value is None else integer(value, f"generationConfig.{key}", minimum, maximum)


def _model_name(resource: str | None) -> str:
    """`models/gemini-2.5-pro` → `gemini-2.5-pro`; tuned models keep their `tunedModels/` prefix."""
    name = unquote(resource or "")
    return name.removeprefix("models/")


def _decode_generate_request(body: dict[str, Any], model: str, *, require_contents: bool) -> Conversation:
    if _get(body, "cachedContent") is not None:
        raise invalid_request("cachedContent is not supported: send the full contents")
    contents = _get(body, "contents")
    contents = [] if contents is None else _list(contents, "contents")
    if require_contents and not contents:
        raise invalid_request("contents must not be empty")
    messages = _system_messages(_get(body, "systemInstruction")) + _content_messages(contents)
    conv = Conversation(messages=messages, model=model, tools=_tools(_get(body, "tools")))
    conv.tool_choice = _tool_choice(_get(body, "toolConfig"))
    _apply_generation_config(conv, _get(body, "generationConfig"))
    return conv


def _system_messages(instruction: Any) -> list[Message]:
    if instruction is None:
        return []
    if isinstance(instruction, str):  # not the REST shape, but SDK-style clients send it
        return [Message(role="system", content=instruction)]
    parts = _list(
        _get(require_dict(instruction, "systemInstruction"), "parts") or [], "systemInstruction.parts"
    )
    texts = []
    for part in parts:
        part = require_dict(part, "systemInstruction.parts[]")
        _reject_unsupported(part)
        text = _opt_str(part, "text")
        if text is not None:
            texts.append(text)
    return [Message(role="system", content="\n".join(texts))] if texts else []


class _CallIds:
    """Ids of function calls and results: Gemini may omit them, pairing a result with its call by name."""

    def __init__(self) -> None:
        self.issued = 0
        self.open: dict[str, list[str]] = {}

    def _fresh(self) -> str:
        self.issued += 1
        return f"call_{self.issued - 1}"

    def for_call(self, name: str, given: str | None) -> str:
        call_id = given or self._fresh()
        self.open.setdefault(name, []).append(call_id)
        return call_id

    def for_result(self, name: str, given: str | None) -> str:
        pending = self.open.get(name, [])
        if given:
            if given in pending:
                pending.remove(given)
            return given
        return pending.pop(0) if pending else self._fresh()


def _content_messages(contents: list[Any]) -> list[Message]:
    ids = _CallIds()
    messages: list[Message] = []
    for i, content in enumerate(contents):
        content = require_dict(content, f"contents[{i}]")
        role = _opt_str(content, "role") or "user"
        parts = [
            require_dict(p, f"contents[{i}].parts[]") for p in _list(_get(content, "parts") or [], "parts")
        ]
        if not parts:  # as Google answers: a turn holds at least one part, and a part holds data
            raise invalid_request(f"contents[{i}].parts must not be empty")
        for j, part in enumerate(parts):
            if not part:
                raise invalid_request(
                    f"contents[{i}].parts[{j}] must hold data (text, functionCall, functionResponse)"
                )
            _reject_unsupported(part)
        if role == "model":
            messages.extend(_model_turn(parts, ids))
        elif role in ("user", "function", "tool"):  # "function" is the older role for function results
            messages.extend(_user_turn(parts, ids))
        else:
            raise invalid_request(f"contents[{i}].role must be 'user' or 'model', got {role!r}")
    if contents and not messages:
        raise invalid_request("contents hold no text, function call or function response to answer")
    return messages


def _reject_unsupported(part: dict[str, Any]) -> None:
    for key in _UNSUPPORTED_PARTS:
        if _get(part, key) is not None:
            raise invalid_request(
                f"{key} parts are not supported: this gateway serves a text-only model "
                "(images/files are not supported)"
            )


def _model_turn(parts: list[dict[str, Any]], ids: _CallIds) -> list[Message]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for part in parts:
        if _get(part, "functionResponse") is not None:
            raise invalid_request("functionResponse parts belong in a user turn, not a model turn")
        call = _get(part, "functionCall")
        if call is not None:
            name, args, given = _named_payload(call, "functionCall", "args")
            calls.append(ToolCall(id=ids.for_call(name, given), name=name, arguments=_json(args)))
        text = _opt_str(part, "text")
        if text is not None:
            (thoughts if _get(part, "thought") is True else texts).append(text)
    if not (texts or thoughts or calls):
        return []
    # Streamed answers come back split into many parts: joining without a separator restores the text.
    return [
        Message(
            role="assistant", content="".join(texts), reasoning="".join(thoughts) or None, tool_calls=calls
        )
    ]


def _user_turn(parts: list[dict[str, Any]], ids: _CallIds) -> list[Message]:
    results: list[Message] = []
    texts: list[str] = []
    for part in parts:
        if _get(part, "functionCall") is not None:
            raise invalid_request("functionCall parts belong in a model turn, not a user turn")
        response = _get(part, "functionResponse")
        if response is not None:
            name, payload, given = _named_payload(response, "functionResponse", "response")
            if _get(response, "parts"):
                raise invalid_request("functionResponse.parts (images/files) are not supported")
            results.append(
                Message(
                    role="tool", name=name, tool_call_id=ids.for_result(name, given), content=_json(payload)
                )
            )
        text = _opt_str(part, "text")
        if text is not None:
            texts.append(text)
    # Tool results answer the previous model turn, so they come before any new user text.
    return results + ([Message(role="user", content="\n".join(texts))] if texts else [])


def _named_payload(value: Any, where: str, payload_key: str) -> tuple[str, dict[str, Any], str | None]:
    """(name, args-or-response object, id) of a functionCall / functionResponse."""
    obj = require_dict(value, where)
    name = _opt_str(obj, "name")
    if not name:
        raise invalid_request(f"{where}.name is required")
    payload = _get(obj, payload_key)
    payload = {} if payload is None else require_dict(payload, f"{where}.{payload_key}")
    return name, payload, _opt_str(obj, "id")


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tools(value: Any) -> list[Tool]:
    tools: list[Tool] = []
    for entry in _list(value if value is not None else [], "tools"):
        declarations = _get(require_dict(entry, "tools[]"), "functionDeclarations")
        # Built-in tools (googleSearch, codeExecution, urlContext) have no meaning for our engine.
        for declaration in _list(declarations if declarations is not None else [], "functionDeclarations"):
            tools.append(_tool(require_dict(declaration, "functionDeclarations[]")))
    return tools


def _tool(declaration: dict[str, Any]) -> Tool:
    name = _opt_str(declaration, "name")
    if not name:
        raise invalid_request("functionDeclarations[].name is required")
    tool = Tool(name=name, description=_opt_str(declaration, "description") or "")
    json_schema = _get(declaration, "parametersJsonSchema")
    openapi_schema = _get(declaration, "parameters")
    if json_schema is not None:
        tool.parameters = dict(require_dict(json_schema, f"{name}.parametersJsonSchema"))
    elif openapi_schema is not None:
        tool.parameters = _json_schema(require_dict(openapi_schema, f"{name}.parameters"), depth=0)
    return tool


def _json_schema(schema: dict[str, Any], depth: int) -> dict[str, Any]:
    """Gemini's OpenAPI-subset Schema (`"type": "OBJECT"`, `nullable`) → JSON Schema (`"type": "object"`)."""
    if depth > _MAX_SCHEMA_DEPTH:
        raise invalid_request("function parameters schema is nested too deeply")
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            if not isinstance(value, str):
                raise invalid_request("schema type must be a string")
            if value.upper() != "TYPE_UNSPECIFIED":
                out["type"] = value.lower()
        elif key in ("properties",):
            out[key] = {
                prop: _json_schema(require_dict(sub, f"properties.{prop}"), depth + 1)
                for prop, sub in require_dict(value, key).items()
            }
        elif key == "items":
            out[key] = _json_schema(require_dict(value, key), depth + 1)
        elif key in ("anyOf", "any_of"):
            out["anyOf"] = [
                _json_schema(require_dict(sub, "anyOf[]"), depth + 1) for sub in _list(value, key)
            ]
        elif key != "nullable":
            out[key] = value
    if schema.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None:
        return None
    config = _get(require_dict(value, "toolConfig"), "functionCallingConfig")
    if config is None:
        return None
    config = require_dict(config, "functionCallingConfig")
    mode = (_opt_str(config, "mode") or "AUTO").upper()
    if mode not in _TOOL_CHOICE:
        raise invalid_request(f"functionCallingConfig.mode must be AUTO, ANY or NONE, got {mode!r}")
    allowed = _list(_get(config, "allowedFunctionNames") or [], "allowedFunctionNames")
    if mode == "ANY" and len(allowed) == 1 and isinstance(allowed[0], str):
        return {"name": allowed[0]}
    return _TOOL_CHOICE[mode]


def _apply_generation_config(conv: Conversation, value: Any) -> None:
    if value is None:
        return
    config = require_dict(value, "generationConfig")
    candidates = _opt_int(config, "candidateCount")
    if candidates is not None and candidates > 1:
        raise invalid_request("candidateCount > 1 is not supported")
    conv.max_tokens = _opt_int(config, "maxOutputTokens", minimum=1, maximum=INT64_MAX)
    conv.temperature = _opt_number(config, "temperature")
    conv.top_p = _opt_number(config, "topP")
    conv.top_k = _opt_int(config, "topK")
    stops = _list(_get(config, "stopSequences") or [], "stopSequences")
    if not all(isinstance(stop, str) for stop in stops):
        raise invalid_request("generationConfig.stopSequences must be strings")
    conv.stop = list(stops)
    conv.thinking = _thinking(_get(config, "thinkingConfig"))
    conv.response_format = structured.from_google(
        _get(config, "responseJsonSchema"), _get(config, "responseSchema"), _get(config, "responseMimeType")
    )


def _thinking(value: Any) -> bool | None:
    """Budget 0 turns thinking off; includeThoughts asks to see it; otherwise the model's default."""
    if value is None:
        return None
    config = require_dict(value, "thinkingConfig")
    budget = _opt_int(config, "thinkingBudget")
    include = _get(config, "includeThoughts")
    if include is not None and not isinstance(include, bool):
        raise invalid_request("thinkingConfig.includeThoughts must be a boolean")
    if budget == 0:
        return False
    return True if include else None


# --- encoding ------------------------------------------------------------------------------------------


def _reasoning_parts(conv: Conversation, completion: Completion) -> list[dict[str, Any]]:
    # Gemini hides thoughts unless the request set includeThoughts.
    if conv.thinking is not True or not completion.reasoning:
        return []
    return [{"text": completion.reasoning, "thought": True}]


def _text_parts(text: str) -> list[dict[str, Any]]:
    return [{"text": text}] if text else []


def _call_parts(completion: Completion) -> list[dict[str, Any]]:
    parts = []
    for call in completion.tool_calls:
        args = call.arguments_obj()
        # Gemini's args is always an object; keep anything else verbatim rather than drop it.
        parts.append(
            {
                "functionCall": {
                    "name": call.name,
                    "args": args if isinstance(args, dict) else {"_raw": call.arguments},
                    "id": call.id,
                }
            }
        )
    return parts


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "promptTokenCount": completion.prompt_tokens,
        "candidatesTokenCount": completion.completion_tokens,
        "totalTokenCount": completion.prompt_tokens + completion.completion_tokens,
    }


def _chunk(
    conv: Conversation, completion: Completion, parts: list[dict[str, Any]], *, final: bool
) -> dict[str, Any]:
    """One GenerateContentResponse; the final one carries finishReason and usage."""
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    response: dict[str, Any] = {"candidates": [candidate]}
    if final:
        candidate["finishReason"] = _FINISH.get(completion.finish_reason, "OTHER")
        response["usageMetadata"] = _usage(completion)
    response["modelVersion"] = conv.model or completion.model
    response["responseId"] = completion.id or "polar-response"
    return response


def _pieces(text: str) -> list[str]:
    return stream_pieces(text, _STREAM_PIECE_CHARS, at_whitespace=True)


def _stream_chunks(conv: Conversation, completion: Completion) -> Iterator[dict[str, Any]]:
    """Thoughts, then text in pieces, then all function calls in one chunk; the last chunk finishes."""
    part_groups = [
        [{"text": piece, "thought": True}]
        for part in _reasoning_parts(conv, completion)
        for piece in _pieces(part["text"])
    ]
    part_groups += [[{"text": piece}] for piece in _pieces(completion.content)]
    if completion.tool_calls:
        part_groups.append(_call_parts(completion))
    part_groups = part_groups or [[{"text": ""}]]
    for i, parts in enumerate(part_groups):
        yield _chunk(conv, completion, parts, final=i == len(part_groups) - 1)
