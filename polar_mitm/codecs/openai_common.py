"""What the two OpenAI codecs (Chat Completions and Responses) share: their base class (hosts' base-URL suffix,
error shape, the local `/v1/models` answers), ids, OpenAI-specific request fields and the stream piece size.

Generic field validation lives in `codecs/common.py`.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any, ClassVar
from urllib.parse import unquote

from polar_mitm.codecs.base import Codec, GatewayError, HttpAnswer
from polar_mitm.codecs.common import invalid_request, require_dict, require_list, require_str

# OpenAI error `code` per gateway error kind, as OpenAI's own API answers them (the type follows the status).
_ERROR_CODES: dict[str, str] = {
    "context_length": "context_length_exceeded",
    "not_found": "unknown_url",
    "overloaded": "engine_unavailable",
    "engine_error": "engine_error",
    "too_large": "request_too_large",
    "headers_too_large": "request_header_fields_too_large",
    "unauthenticated": "invalid_api_key",
    "internal": "internal_error",
}

# Characters per streamed delta: small enough that harnesses render progressively, large enough to keep the
# replay short (the answer is complete before the stream starts).
DELTA_CHARS = 32

# When the models listing says a model was created: the gateway's start, stable across calls.
MODELS_CREATED_AT = int(time.time())


class OpenAICodec(Codec):
    """The base of the OpenAI codecs: `/v1` in the SDK base URL, OpenAI's error shape, `GET /v1/models` answered
    locally (no count-tokens endpoint)."""

    base_url_suffix: ClassVar[str] = "/v1"
    call_path: ClassVar[str]  # the model call's path suffix, under any prefix

    def matches(self, path: str) -> bool:
        return path_only(path).endswith(self.call_path)

    def encode_error(self, error: GatewayError) -> HttpAnswer:
        """OpenAI's `{"error": {message, type, param, code}}`."""
        return openai_error_answer(error, self.status_for(error))

    def models_path(self, path: str, method: str) -> bool:
        """A model listing (`…/models`) or lookup (`…/v1/models/{id}`)?"""
        if method.upper() != "GET":
            return False
        path = path_only(path)
        return path.endswith("/models") or _model_id_in(path) is not None

    def encode_models(self, model_ids: list[str], path: str) -> dict[str, Any]:
        """The listing, or the one model object a lookup names (any id: the gateway serves every name)."""
        wanted = _model_id_in(path_only(path))
        if wanted is not None:
            return _model_object(wanted)
        return {"object": "list", "data": [_model_object(model_id) for model_id in model_ids]}


def openai_error_answer(error: GatewayError, status: int) -> HttpAnswer:
    """`{"error": {message, type, param, code}}` with the status OpenAI uses for this kind of failure."""
    error_type = "invalid_request_error" if status < 500 else "server_error"
    # OpenAI's wording; harnesses match the code (Codex) or "maximum context length" (AI SDK, Qwen Code).
    message = error.worded(
        "This model's maximum context length is {limit} tokens. However, your messages "
        "resulted in {n} tokens. Please reduce the length of the messages."
    )
    return HttpAnswer.json(
        status,
        {
            "error": {
                "message": message,
                "type": error_type,
                "param": None,
                "code": _ERROR_CODES.get(error.kind),
            }
        },
    )


def id_core(engine_id: str) -> str:
    """The engine's completion id, alphanumerics only, to build provider ids from (so they can be traced to
    records); random when the engine gave none."""
    core = re.sub(r"[^A-Za-z0-9]", "", engine_id.removeprefix("chatcmpl-"))
    return core or secrets.token_hex(12)


def path_only(path: str) -> str:
    """The path without query string and trailing slashes (callers may pass either)."""
    return path.split("?", 1)[0].rstrip("/")


# ---- OpenAI request fields ---------------------------------------------------------------------------


def parse_stop(value: Any) -> list[str]:
    """`stop`: a string or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise invalid_request("stop must be a string or an array of strings")


def content_text(content: Any, where: str, text_parts: tuple[str, ...], media_parts: tuple[str, ...]) -> str:
    """Message content: a string, null, or a list of parts whose text (and refusal) parts are concatenated.

    `text_parts` are the part types that carry `text`; `media_parts` those a text-only model cannot read.
    """
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, raw in enumerate(require_list(content, where)):
        part = require_dict(raw, f"{where}[{j}]")
        kind = part.get("type")
        if kind in text_parts:
            texts.append(require_str(part.get("text"), f"{where}[{j}].text"))
        elif kind == "refusal":
            texts.append(require_str(part.get("refusal"), f"{where}[{j}].refusal"))
        elif kind in media_parts:
            raise invalid_request(
                f"{where}[{j}]: {kind} content is not supported (images, audio and files are not "
                "supported: the model is text-only)"
            )
        else:
            raise invalid_request(
                f"{where}[{j}].type {kind!r} is not a supported content part type (text only)"
            )
    return "".join(texts)


def thinking_from_effort(effort: Any, where: str) -> bool | None:
    """OpenAI reasoning effort → ask for thinking or not ("none"/"minimal" mean no thinking)."""
    if effort is None:
        return None
    effort = require_str(effort, where)
    return effort not in ("none", "minimal")


def arguments_text(value: Any, where: str) -> str:
    """Tool-call arguments as the text the model wrote; some clients send the parsed object instead."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise invalid_request(f"{where} must be a string")


def custom_tool_parameters(input_format: Any) -> dict[str, Any]:
    """The JSON schema a local model sees for an OpenAI custom (free-form text) tool: one string, `input`.

    A grammar format is put into the field's description: the model has no other way to learn it.
    """
    field: dict[str, Any] = {"type": "string"}
    if isinstance(input_format, dict) and input_format.get("type") == "grammar":
        syntax, definition = input_format.get("syntax"), input_format.get("definition")
        if isinstance(definition, str) and definition:
            field["description"] = f"Text following this {syntax or ''} grammar:\n{definition}"
    return {"type": "object", "properties": {"input": field}, "required": ["input"]}


def custom_tool_arguments(input_text: str) -> str:
    """A custom tool call's free-form input as the JSON arguments a local model writes."""
    return json.dumps({"input": input_text}, ensure_ascii=False)


def _model_id_in(path: str) -> str | None:
    # Model ids may hold slashes ("Qwen/Qwen3-8B"): everything after `/v1/models/` is the id.
    _, sep, tail = path.partition("/v1/models/")
    return unquote(tail) if sep and tail else None


def _model_object(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": MODELS_CREATED_AT, "owned_by": "polar-mitm"}
