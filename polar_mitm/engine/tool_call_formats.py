"""Tool-call notations, one class per model family, named as SGLang's and vLLM's `--tool-call-parser`.

Every notation here sits between `<tool_call>` and `</tool_call>`; `parsers.py` finds those blocks (whole texts and
streams alike) and hands each block to the engine's format, which reads one call out of it:

- `hermes` / `qwen25`: a JSON object `{"name": …, "arguments": {…}}` (Qwen2.5, Qwen3, Hermes).
- `qwen3_coder`: `<function=NAME>` holding one `<parameter=KEY>` per argument, each value raw text (it may span
  lines) converted to the JSON-schema type the request's tool gives that parameter (Qwen3-Coder, Qwen3.5; vLLM's
  and SGLang's `qwen3_coder` parsers read the same notation).

A block that is not a call the harness could run — broken JSON, a function never closed, a parameter its tool does
not declare, a tool the request never offered — reads as None, and the caller keeps it in the answer as text (the
record keeps the sampled ids whatever the parse). Standard library only: the gateway imports it without torch.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from polar_mitm.user_errors import UserInputError

# The request's tools: their names, or name → JSON-schema `parameters` (what `tool_parameters` builds); None: any.
OfferedTools = Collection[str] | Mapping[str, Any] | None


class UnknownToolCallParser(UserInputError):
    """A `--tool-call-parser` name no format here answers to."""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self, index: int) -> dict:
        return {
            "id": self.id,
            "index": index,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call(name: str, arguments: dict[str, Any]) -> ParsedCall:
    return ParsedCall(
        id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=json.dumps(arguments, ensure_ascii=False)
    )


def tool_parameters(tools: Sequence[Any] | None) -> dict[str, dict[str, Any]]:
    """name → JSON-schema `parameters` of OpenAI-style tool definitions (`{}` when a tool gives none; malformed
    entries are the chat template's problem)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            out[function["name"]] = parameters if isinstance(parameters, dict) else {}
    return out


class ToolCallFormat:
    """One notation: reads the call inside one `<tool_call>` block."""

    names: ClassVar[tuple[str, ...]]  # the `--tool-call-parser` names it answers to

    def parse_block(self, block: str, offered: OfferedTools) -> ParsedCall | None:
        """The call `block` (the text between the tags) holds, or None when it is not one the harness could run."""
        raise NotImplementedError


class HermesJson(ToolCallFormat):
    """`{"name": str, "arguments"|"parameters": object}` naming an offered tool (arguments may come as a JSON
    string, as some models write them)."""

    names = ("hermes", "qwen25")

    def parse_block(self, block: str, offered: OfferedTools) -> ParsedCall | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict) or (offered is not None and name not in offered):
            return None
        return new_call(name, args)


FUNCTION_RE = re.compile(r"<function=([^<>\s\"'{}]+)>(.*)</function>", re.DOTALL)
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
PARAMETER_NAME_RE = re.compile(r"[^<>\s\"'{}]+")
PARAMETER_LINE_RE = re.compile(r"\n<parameter=")


class Qwen3CoderXml(ToolCallFormat):
    """`<function=NAME>` + `<parameter=KEY>\\nVALUE\\n</parameter>`… + `</function>`, as Qwen3-Coder's chat template
    writes a call. One function per block; whitespace only between the parameters. Values convert by the schema of
    the request's tool (integer, number, boolean, null, object and array parsed; a string, an untyped parameter and
    a value that does not convert stay text, as vLLM's parser keeps them). A parameter the tool's `properties` do not
    list is refused unless its schema allows `additionalProperties`; a tool with no `properties` takes any."""

    names = ("qwen3_coder",)

    def parse_block(self, block: str, offered: OfferedTools) -> ParsedCall | None:
        match = FUNCTION_RE.fullmatch(block.strip())
        if match is None:  # no function, one never closed, or text around it
            return None
        name, body = match.groups()
        if offered is not None and name not in offered:
            return None
        raw = raw_parameters(body)
        if raw is None:
            return None
        schema = offered.get(name) if isinstance(offered, Mapping) else None
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        extra = schema.get("additionalProperties") if isinstance(schema, Mapping) else None
        arguments: dict[str, Any] = {}
        for key, text in raw.items():
            if not isinstance(properties, Mapping):
                arguments[key] = text  # no declared parameters (or no schema known): the text as it is
            elif key in properties:
                arguments[key] = typed_value(text, properties[key])
            elif extra is True or isinstance(extra, Mapping):
                arguments[key] = typed_value(text, extra if isinstance(extra, Mapping) else {})
            else:
                return None  # a parameter the tool does not have
        return new_call(name, arguments)


def raw_parameters(body: str) -> dict[str, str] | None:
    """KEY → raw text of each `<parameter=KEY>` in a function's body; None when the body is anything else (text
    between parameters, a parameter never closed, a key given twice)."""
    values: dict[str, str] = {}
    pos = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body):
            return values
        if not body.startswith(PARAMETER_OPEN, pos):
            return None
        name_end = body.find(">", pos)
        key = body[pos + len(PARAMETER_OPEN) : name_end] if name_end >= 0 else ""
        if not PARAMETER_NAME_RE.fullmatch(key) or key in values:
            return None
        end = value_end(body, name_end + 1)
        if end < 0:
            return None
        value = body[name_end + 1 : end]
        value = value[1:] if value.startswith("\n") else value  # the template's newlines around the value
        values[key] = value[:-1] if value.endswith("\n") else value
        pos = end + len(PARAMETER_CLOSE)


def value_end(body: str, start: int) -> int:
    """Where the value starting at `start` ends: the first `</parameter>` followed by the next parameter or by the
    end of the function (so a value may itself hold `</parameter>`, e.g. in code); -1 when there is none, or when a
    line of the value opens another parameter (this one was never closed)."""
    end = body.find(PARAMETER_CLOSE, start)
    while end >= 0:
        after = body[end + len(PARAMETER_CLOSE) :].lstrip()
        if not after or after.startswith(PARAMETER_OPEN):
            break
        end = body.find(PARAMETER_CLOSE, end + 1)
    if end < 0 or body.startswith(PARAMETER_OPEN, start) or PARAMETER_LINE_RE.search(body, start, end):
        return -1
    return end


def schema_types(schema: Any) -> tuple[list[str], bool]:
    """(the JSON types a parameter schema names, in order, null left out; whether null is allowed)."""
    if not isinstance(schema, Mapping):
        return [], False
    named = schema.get("type")  # "integer", or a list such as ["string", "null"]
    named = [named] if isinstance(named, str) else named if isinstance(named, list) else []
    types = [t for t in named if isinstance(t, str)]
    for option in schema.get("anyOf") or schema.get("oneOf") or []:
        option_types, option_nullable = schema_types(option)
        types.extend(option_types + ["null"] * option_nullable)
    return [t for t in types if t != "null"], "null" in types


def typed_value(text: str, schema: Any) -> Any:
    """`text` as the value `schema` asks for; the text itself when the schema allows a string, names no type, or
    the text does not convert to any type it names."""
    types, nullable = schema_types(schema)
    stripped = text.strip()
    if nullable and stripped in ("null", "None"):
        return None
    if not types or "string" in types:
        return text
    for kind in types:
        converted = CONVERTERS.get(kind, _unconverted)(stripped)
        if converted is not _UNCONVERTED:
            return converted
    return text


_UNCONVERTED = object()


def _unconverted(text: str) -> Any:
    return _UNCONVERTED


def _integer(text: str) -> Any:
    return int(text) if re.fullmatch(r"[-+]?\d+", text) else _UNCONVERTED


def _number(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return _UNCONVERTED
    return value if isinstance(value, int | float) and not isinstance(value, bool) else _UNCONVERTED


def _boolean(text: str) -> Any:
    # Qwen3-Coder's template renders Python's `True`/`False`; JSON's lower case is as likely.
    return {"true": True, "false": False}.get(text.lower(), _UNCONVERTED)


def _container(kind: type) -> Any:
    def convert(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError:
            try:  # a Python literal (`{'k': 'v'}`): what a template that wrote str(dict) taught the model
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return _UNCONVERTED
        return value if isinstance(value, kind) else _UNCONVERTED

    return convert


CONVERTERS = {
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "object": _container(dict),
    "array": _container(list),
}

FORMATS: tuple[ToolCallFormat, ...] = (HermesJson(), Qwen3CoderXml())
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {name: fmt for fmt in FORMATS for name in fmt.names}
TOOL_CALL_PARSER_NAMES: tuple[str, ...] = (*TOOL_CALL_FORMATS, "none")  # what `--tool-call-parser` accepts
# An engine whose model names no parser: the `<tool_call>{json}</tool_call>` notation of Qwen2.5/Qwen3 (and of the
# tiny and SmolLM2 models' chat template).
DEFAULT_TOOL_CALL_PARSER = "qwen25"


def tool_call_format(name: str) -> ToolCallFormat | None:
    """The format a `--tool-call-parser` name picks (None for `none`: answers are never parsed for calls)."""
    if name == "none":
        return None
    if name not in TOOL_CALL_FORMATS:
        raise UnknownToolCallParser(
            f"unknown tool-call parser {name!r}: choose one of {', '.join(TOOL_CALL_PARSER_NAMES)}"
        )
    return TOOL_CALL_FORMATS[name]
