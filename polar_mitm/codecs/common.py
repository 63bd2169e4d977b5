"""What every provider codec shares: request-body parsing and field validation, the stream slicer and the one SSE
frame encoder (the embedded engine's server writes its frames with it too).

Validators raise `GatewayError("invalid_request", …)` naming the bad field, so a harness sees a clear 400 instead of
a gateway crash. Each provider keeps its own wording (`expect`'s `wording`): harnesses and tests read it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

from polar_mitm.codecs.base import GatewayError

# Integer bounds of request fields. Sampling counts (top_k, n, thinking budgets) end up in int32 record columns
# and engine tensors; a token budget may be any 64-bit value (the gateway caps it before the engine sees it).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# JSON nesting a request may have. Real tool schemas are < 20 deep; the JSON encoder stops at 255 levels, and the
# request is re-nested a few levels deeper in the engine request and the record.
MAX_JSON_DEPTH = 128

MUST_BE = "{where} must be {what}"  # the OpenAI and Google wording of a wrongly typed field


def invalid_request(message: str) -> GatewayError:
    return GatewayError("invalid_request", message)


# ---- the request body --------------------------------------------------------------------------------------


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Is `value` (parsed JSON) nested more than `limit` containers deep? Iterative: deep input is the threat."""
    if not isinstance(value, dict | list):
        return False
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def parse_body(raw: bytes) -> Any:
    """A request body as JSON, or a client error: not JSON, or nested deeper than MAX_JSON_DEPTH."""
    try:
        body = orjson.loads(raw)
    except ValueError as exc:
        raise invalid_request("the request body is not valid JSON") from exc
    if nesting_exceeds(body, MAX_JSON_DEPTH):
        raise invalid_request(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
    return body


# ---- field validation --------------------------------------------------------------------------------------


def expect(value: Any, kind: type | tuple[type, ...], where: str, what: str, wording: str = MUST_BE) -> Any:
    """`value` if it is a `kind`, else a client error worded by `wording` ({where}, {what}, {got}: the type sent).

    JSON booleans are not numbers: `true` passes only where `bool` is asked for.
    """
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
        return value
    raise invalid_request(wording.format(where=where, what=what, got=type(value).__name__))


def require_dict(value: Any, where: str) -> dict[str, Any]:
    return expect(value, dict, where, "a JSON object")


def require_list(value: Any, where: str, what: str = "an array") -> list[Any]:
    return expect(value, list, where, what)


def require_str(value: Any, where: str) -> str:
    return expect(value, str, where, "a string")


def check_int_range(value: int, where: str, minimum: int, maximum: int) -> int:
    """`value` if it lies in [minimum, maximum]; otherwise a client error naming the field."""
    if value < minimum:
        raise invalid_request(f"{where} must be at least {minimum}")
    if value > maximum:
        raise invalid_request(f"{where} must be at most {maximum}")
    return value


def finite_number(value: Any, where: str) -> int | float:
    """`value` if it is a finite JSON number (not a boolean: `"temperature": true` is a client bug, not 1.0)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid_request(f"{where} must be a finite number")
    return value


def integer(value: Any, where: str, minimum: int, maximum: int) -> int:
    """An integer within [minimum, maximum]; a whole float (`8.0`) counts, `1e30` is out of range."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(f"{where} must be an integer")
    return check_int_range(value, where, minimum, maximum)


def optional_str(body: dict[str, Any], key: str, where: str = "") -> str | None:
    value = body.get(key)
    return None if value is None else require_str(value, f"{where}{key}")


def optional_dict(body: dict[str, Any], key: str, where: str = "") -> dict[str, Any] | None:
    value = body.get(key)
    return None if value is None else require_dict(value, f"{where}{key}")


def optional_bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    return None if value is None else expect(value, bool, key, "a boolean")


def optional_number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    return None if value is None else float(finite_number(value, key))


def optional_int(body: dict[str, Any], key: str, minimum: int = 0, maximum: int = INT32_MAX) -> int | None:
    value = body.get(key)
    return None if value is None else integer(value, key, minimum, maximum)


# ---- streaming ---------------------------------------------------------------------------------------------

_WORDS = re.compile(r"\S*\s*")  # a word and the whitespace after it


def stream_pieces(text: str, size: int, *, at_whitespace: bool = False) -> list[str]:
    """`text` in pieces to stream (none for empty text); they join back to `text` exactly.

    Pieces are `size` characters, or with `at_whitespace` at least `size` characters cut after whitespace, so
    words arrive whole. The answer is complete before a replayed stream starts: pieces only pace its rendering.
    """
    if not at_whitespace:
        return [text[i : i + size] for i in range(0, len(text), size)]
    pieces: list[str] = []
    piece = ""
    for word in _WORDS.findall(text):
        piece += word
        if len(piece) >= size:
            pieces.append(piece)
            piece = ""
    if piece:
        pieces.append(piece)
    return pieces


def sse_event(data: Any, event: str | None = None) -> bytes:
    """One Server-Sent Event frame: `data` as JSON, under `event` when given."""
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(data, ensure_ascii=False) + "\n\n").encode()


SSE_DONE = b"data: [DONE]\n\n"  # the end of an OpenAI-style stream (Chat Completions, SGLang's /generate)
SSE_KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: every SSE client skips it, and the idle timer restarts
