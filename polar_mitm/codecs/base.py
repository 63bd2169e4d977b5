"""The one interface every provider codec implements, and the typed errors that carry a provider-facing shape.

A codec is pure: bytes/JSON in, JSON/SSE bytes out. It never imports mitmproxy and never does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import orjson

from polar_mitm.conversation import Completion, Conversation

ErrorKind = Literal[
    "invalid_request",  # malformed body, wrong types, unsupported content (images) → 400
    "context_length",  # prompt longer than the engine's context → 400
    "not_found",  # an endpoint we do not serve → 404
    "overloaded",  # engine unreachable / timed out → Anthropic 529, OpenAI 503, Google 503
    "engine_error",  # engine answered 5xx or nonsense → 502
    "too_large",  # request body over the gateway's size limit → 413
    "internal",  # a gateway bug: still answered in the provider's shape → 500
]

# Integer bounds of request fields. Sampling counts (top_k, n, thinking budgets) end up in int32 record columns
# and engine tensors; a token budget may be any 64-bit value (the gateway caps it before the engine sees it).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# JSON nesting a request may have. Real tool schemas are < 20 deep; the JSON encoder stops at 255 levels, and the
# request is re-nested a few levels deeper in the engine request and the record.
MAX_JSON_DEPTH = 128


class GatewayError(Exception):
    """An error to show the harness in its provider's own shape (see `Codec.encode_error`)."""

    def __init__(self, kind: ErrorKind, message: str, *, tokens: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.tokens = tokens  # context_length: (prompt tokens, context limit) when the engine said

    def worded(self, overflow_template: str) -> str:
        """The message, or — for a context overflow with known counts — the provider's own wording of it
        (`{n}` prompt tokens, `{limit}` maximum): harnesses match that text to decide to compact and retry."""
        if self.kind == "context_length" and self.tokens is not None:
            return overflow_template.format(n=self.tokens[0], limit=self.tokens[1])
        return self.message


def invalid_request(message: str) -> GatewayError:
    return GatewayError("invalid_request", message)


def check_int_range(value: int, where: str, minimum: int, maximum: int) -> int:
    """`value` if it lies in [minimum, maximum]; otherwise a client error naming the field."""
    if value < minimum:
        raise invalid_request(f"{where} must be at least {minimum}")
    if value > maximum:
        raise invalid_request(f"{where} must be at most {maximum}")
    return value


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


@dataclass
class HttpAnswer:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] | None = None
    meta: dict[str, Any] | None = None  # for the transport layer (e.g. the record, kept in flow metadata)

    @classmethod
    def json(cls, status: int, payload: Any, headers: dict[str, str] | None = None) -> HttpAnswer:
        return cls(status, json.dumps(payload, ensure_ascii=False).encode(), "application/json", headers)


def sse_event(data: Any, event: str | None = None) -> bytes:
    """One Server-Sent Event frame."""
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(data, ensure_ascii=False) + "\n\n").encode()


class Codec:
    """Base class of the provider codecs.

    Subclasses set `name` and implement `matches`, `decode_request`, `encode_response`, `encode_stream` and
    `encode_error`. `stream_requested` tells whether the harness asked for SSE.
    """

    name: ClassVar[str]

    def matches(self, path: str) -> bool:
        """Does this request path (without host and query) belong to this API's model call?"""
        raise NotImplementedError

    def stream_requested(self, body: dict[str, Any], path: str, query: dict[str, str]) -> bool:
        return bool(body.get("stream"))

    def decode_request(self, body: Any, path: str, query: dict[str, str]) -> Conversation:
        """Provider request JSON → Conversation. Raises GatewayError("invalid_request", …) on bad input."""
        raise NotImplementedError

    def encode_response(self, conv: Conversation, completion: Completion) -> dict[str, Any]:
        """The provider's non-streaming response JSON."""
        raise NotImplementedError

    def encode_stream(self, conv: Conversation, completion: Completion) -> Iterator[bytes]:
        """The provider's complete SSE event sequence for a finished completion."""
        raise NotImplementedError

    def encode_error(self, error: GatewayError) -> HttpAnswer:
        """The provider's error shape and status for `error`."""
        raise NotImplementedError


class AuxCodec:
    """Optional hooks for a provider's auxiliary endpoints, answered locally so harnesses work offline."""

    def count_tokens_path(self, path: str) -> bool:
        """Is this the provider's token-counting endpoint (Anthropic count_tokens, Google :countTokens)?"""
        return False

    def decode_count_tokens(self, body: Any, path: str, query: dict[str, str]) -> Conversation:
        """The conversation whose tokens to count."""
        return self.decode_request(body, path, query)  # type: ignore[attr-defined]

    def encode_count_tokens(self, n_tokens: int) -> dict[str, Any]:
        raise NotImplementedError

    def models_path(self, path: str, method: str) -> bool:
        """Is this a model listing / model lookup request?"""
        return False

    def encode_models(self, model_ids: list[str], path: str) -> dict[str, Any]:
        raise NotImplementedError
