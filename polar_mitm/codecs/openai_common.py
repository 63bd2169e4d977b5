"""What the two OpenAI codecs (Chat Completions and Responses) share: the error shape, ids, request-field
validation, stream slicing and the local `/v1/models` answers.

Validation helpers raise `GatewayError("invalid_request", …)` with the JSON path of the bad field, so a
harness sees a clear 400 instead of a gateway crash.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from typing import Any
from urllib.parse import unquote

from polar_mitm.codecs.base import INT32_MAX, AuxCodec, GatewayError, HttpAnswer, check_int_range

# (status, OpenAI error type, code) per gateway error kind, as OpenAI's own API answers them.
_ERROR_SHAPES: dict[str, tuple[int, str, str | None]] = {
    "invalid_request": (400, "invalid_request_error", None),
    "context_length": (400, "invalid_request_error", "context_length_exceeded"),
    "not_found": (404, "invalid_request_error", "unknown_url"),
    "overloaded": (503, "server_error", "engine_unavailable"),
    "engine_error": (502, "server_error", "engine_error"),
    "too_large": (413, "invalid_request_error", "request_too_large"),
    "internal": (500, "server_error", "internal_error"),
}

# Characters per streamed delta: small enough that harnesses render progressively, large enough to keep the
# replay short (the answer is complete before the stream starts).
DELTA_CHARS = 32

# When the models listing says a model was created: the gateway's start, stable across calls.
MODELS_CREATED_AT = int(time.time())


def openai_error_answer(error: GatewayError) -> HttpAnswer:
    """`{"error": {message, type, param, code}}` with the status OpenAI uses for this kind of failure."""
    status, error_type, code = _ERROR_SHAPES.get(error.kind, (500, "server_error", None))
    # OpenAI's wording; harnesses match the code (Codex) or "maximum context length" (AI SDK, Qwen Code).
    message = error.worded("This model's maximum context length is {limit} tokens. However, your messages "
                           "resulted in {n} tokens. Please reduce the length of the messages.")
    return HttpAnswer.json(status, {"error": {"message": message, "type": error_type, "param": None,
                                              "code": code}})


def invalid(message: str) -> GatewayError:
    return GatewayError("invalid_request", message)


def id_core(engine_id: str) -> str:
    """The engine's completion id, alphanumerics only, to build provider ids from (so they can be traced to
    records); random when the engine gave none."""
    core = re.sub(r"[^A-Za-z0-9]", "", engine_id.removeprefix("chatcmpl-"))
    return core or secrets.token_hex(12)


def path_only(path: str) -> str:
    """The path without query string and trailing slashes (callers may pass either)."""
    return path.split("?", 1)[0].rstrip("/")


# ---- request-field validation ------------------------------------------------------------------------------

def require_dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"{where} must be a JSON object")
    return value


def require_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(f"{where} must be an array")
    return value


def require_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"{where} must be a string")
    return value


def optional_str(body: dict[str, Any], key: str, where: str = "") -> str | None:
    value = body.get(key)
    if value is None:
        return None
    return require_str(value, f"{where}{key}")


def optional_dict(body: dict[str, Any], key: str, where: str = "") -> dict[str, Any] | None:
    value = body.get(key)
    if value is None:
        return None
    return require_dict(value, f"{where}{key}")


def optional_bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(f"{key} must be a boolean")
    return value


def optional_number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    # bool is an int subclass: `"temperature": true` is a client bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"{key} must be a finite number")
    return float(value)


def optional_int(body: dict[str, Any], key: str, minimum: int = 0, maximum: int = INT32_MAX) -> int | None:
    """An integer field within [minimum, maximum]; a whole float (`8.0`) counts, `1e30` is out of range."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{key} must be an integer")
    return check_int_range(value, key, minimum, maximum)


def parse_stop(value: Any) -> list[str]:
    """`stop`: a string or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise invalid("stop must be a string or an array of strings")


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
    raise invalid(f"{where} must be a string")


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


# ---- streaming ---------------------------------------------------------------------------------------------

def split_text(text: str, size: int = DELTA_CHARS) -> list[str]:
    """`text` in stream-sized pieces (none for empty text)."""
    return [text[i:i + size] for i in range(0, len(text), size)]


# ---- /v1/models --------------------------------------------------------------------------------------------

class OpenAIModels(AuxCodec):
    """OpenAI's `GET /v1/models` and `GET /v1/models/{id}`, answered locally (no count-tokens endpoint)."""

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


def _model_id_in(path: str) -> str | None:
    # Model ids may hold slashes ("Qwen/Qwen3-8B"): everything after `/v1/models/` is the id.
    _, sep, tail = path.partition("/v1/models/")
    return unquote(tail) if sep and tail else None


def _model_object(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": MODELS_CREATED_AT, "owned_by": "polar-mitm"}
