"""Structured-output requests of the four APIs → the one shape SGLang's chat endpoint takes: `response_format`.

OpenAI Chat `response_format` (json_schema | json_object), Responses `text.format`, Google
`generationConfig.responseJsonSchema` / `responseSchema` (OpenAPI subset) / `responseMimeType`, and Anthropic's
`output_format` (structured-outputs beta) / `output_config.format` all become
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` or `{"type": "json_object"}`. The engine
then constrains decoding to it (engine/constraints.py; SGLang: its grammar backend), and the record says so.
"""

from __future__ import annotations

from typing import Any

from polar_mitm.codecs.common import invalid_request

ResponseFormat = dict[str, Any]


def json_schema_format(schema: Any, name: str = "response", strict: Any = None) -> ResponseFormat:
    if not isinstance(schema, dict):
        raise invalid_request("a structured-output schema must be a JSON object")
    spec: dict[str, Any] = {"name": name if isinstance(name, str) and name else "response", "schema": schema}
    if isinstance(strict, bool):
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def from_openai_chat(value: Any) -> ResponseFormat | None:
    """Chat Completions `response_format`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_request("response_format must be an object")
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid_request("response_format.json_schema must be an object")
        return json_schema_format(
            spec.get("schema", {"type": "object"}), spec.get("name", ""), spec.get("strict")
        )
    raise invalid_request(f"response_format.type {kind!r} is not supported")


def from_responses_text(value: Any) -> ResponseFormat | None:
    """Responses `text.format` (flat: `{"type": "json_schema", "name", "schema", "strict"}`)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_request("text must be an object")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_request("text.format must be an object")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return json_schema_format(fmt.get("schema"), fmt.get("name", ""), fmt.get("strict"))
    raise invalid_request(f"text.format.type {kind!r} is not supported")


def from_anthropic(body: dict[str, Any]) -> ResponseFormat | None:
    """Anthropic structured outputs: `output_format` (beta) or `output_config.format`."""
    fmt = body.get("output_format")
    config = body.get("output_config")
    if fmt is None and isinstance(config, dict):
        fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise invalid_request('output_format must be {"type": "json_schema", "schema": {...}}')
    return json_schema_format(fmt.get("schema"))


def from_google(json_schema: Any, openapi_schema: Any, mime_type: Any) -> ResponseFormat | None:
    """Google `responseJsonSchema` (JSON Schema), else `responseSchema` (OpenAPI subset), else JSON mime type."""
    if json_schema is not None:
        return json_schema_format(lower_type_names(json_schema))
    if openapi_schema is not None:
        return json_schema_format(openapi_to_json_schema(openapi_schema))
    if mime_type == "application/json":
        return {"type": "json_object"}
    return None


_TYPE_NAMES = {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"}


def lower_type_names(schema: Any) -> Any:
    """`"type": "OBJECT"` → `"object"` throughout a schema.

    Gemini accepts its SDK's upper-case `Type` names inside `responseJsonSchema` too, and Gemini CLI sends them
    (`Type.OBJECT` from @google/genai); JSON Schema — and so the engine's grammar compiler — knows only lower case.
    """
    if isinstance(schema, list):
        return [lower_type_names(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: lower_type_names(value) for key, value in schema.items()}
    kind = schema.get("type")
    if isinstance(kind, str) and kind in _TYPE_NAMES:
        out["type"] = kind.lower()
    elif isinstance(kind, list):
        out["type"] = [k.lower() if isinstance(k, str) and k in _TYPE_NAMES else k for k in kind]
    return out


_OPENAPI_KEYS = {
    "description",
    "enum",
    "format",
    "minimum",
    "maximum",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "title",
    "default",
    "minProperties",
    "maxProperties",
}


def openapi_to_json_schema(schema: Any) -> dict[str, Any]:
    """Gemini's `Schema` (OpenAPI 3.0 subset: upper-case `type`, `nullable`, `propertyOrdering`) → JSON Schema."""
    if not isinstance(schema, dict):
        raise invalid_request("responseSchema must be an object")
    out: dict[str, Any] = {k: v for k, v in schema.items() if k in _OPENAPI_KEYS}
    kind = schema.get("type")
    if isinstance(kind, str) and kind.upper() != "TYPE_UNSPECIFIED":
        out["type"] = kind.lower()
    if schema.get("nullable") is True and "type" in out:
        out["type"] = [out["type"], "null"]
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: openapi_to_json_schema(v) for k, v in schema["properties"].items()}
        out["additionalProperties"] = False  # Gemini answers with the declared properties only
    if isinstance(schema.get("required"), list):
        out["required"] = schema["required"]
    if schema.get("items") is not None:
        out["items"] = openapi_to_json_schema(schema["items"])
    if isinstance(schema.get("anyOf"), list):
        out["anyOf"] = [openapi_to_json_schema(s) for s in schema["anyOf"]]
    return out
