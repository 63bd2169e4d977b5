"""The one interface every provider codec implements, and the typed errors that carry a provider-facing shape.

A codec is pure: bytes/JSON in, JSON/SSE bytes out. It never imports mitmproxy and never does I/O. Everything the
gateway, the rollout and the SDK agent need to know about a provider API is declared here, on its codec class:
the hosts it is served from, the paths of its model call and auxiliary endpoints, the suffix an SDK's base URL
carries, its error statuses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from polar_mitm.conversation import Completion, Conversation

ErrorKind = Literal[
    "invalid_request",  # malformed body, wrong types, unsupported content (images) → 400
    "context_length",  # prompt longer than the engine's context → 400
    "not_found",  # an endpoint we do not serve → 404
    "overloaded",  # engine unreachable / timed out → Anthropic 529, OpenAI 503, Google 503
    "engine_error",  # engine answered 5xx or nonsense → 502 (Anthropic, Google: 500)
    "too_large",  # request body over the gateway's size limit → 413
    "headers_too_large",  # more header lines or bytes than the gateway takes → 431
    "unauthenticated",  # a rollout gateway's call without a valid session credential → 401
    "internal",  # a gateway bug: still answered in the provider's shape → 500
]

# The HTTP status of each error kind; a codec overrides those its API answers differently (`Codec.error_status`).
ERROR_STATUS: dict[str, int] = {
    "invalid_request": 400,
    "context_length": 400,
    "not_found": 404,
    "overloaded": 503,
    "engine_error": 502,
    "too_large": 413,
    "headers_too_large": 431,
    "unauthenticated": 401,
    "internal": 500,
}


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


class Codec:
    """Base class of the provider codecs.

    Subclasses set `name` and implement `matches`, `decode_request`, `encode_response`, `encode_stream` and
    `encode_error`; the class attributes and the auxiliary-endpoint hooks have defaults for an API without them.
    """

    name: ClassVar[str]
    # Hosts whose traffic is this API's (regular proxy mode: the harness talks to the provider's real host).
    hosts: ClassVar[tuple[str, ...]] = ()
    # What an SDK's base URL adds after the gateway's URL (and session prefix) to reach this API.
    base_url_suffix: ClassVar[str] = ""
    # Clients of this API open it as a WebSocket first (Codex and the Responses API).
    websocket_first: ClassVar[bool] = False
    # Every call of this endpoint asks for a summary of the conversation (a remote compaction endpoint).
    compaction: ClassVar[bool] = False
    error_status: ClassVar[dict[str, int]] = ERROR_STATUS

    # -- the model call ----------------------------------------------------------------------------------------

    def matches(self, path: str) -> bool:
        """Does this request path (without host and query) belong to this API's model call?"""
        raise NotImplementedError

    def owns_path(self, path: str) -> bool:
        """Is `path` one of this API's endpoints, model call or not, by its shape alone? Asked for requests to a
        reverse gateway that no host or header attributes; only an API with distinctive paths says yes."""
        return False

    def stream_requested(self, body: dict[str, Any], path: str, query: dict[str, str]) -> bool:
        """Did the harness ask for SSE?"""
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

    def status_for(self, error: GatewayError) -> int:
        """The HTTP status this API answers `error` with."""
        return self.error_status.get(error.kind, 500)

    # -- auxiliary endpoints, answered locally so harnesses work offline ---------------------------------------

    def count_tokens_path(self, path: str) -> bool:
        """Is this the provider's token-counting endpoint (Anthropic count_tokens, Google :countTokens)?"""
        return False

    def decode_count_tokens(self, body: Any, path: str, query: dict[str, str]) -> Conversation:
        """The conversation whose tokens to count."""
        return self.decode_request(body, path, query)

    def encode_count_tokens(self, n_tokens: int) -> dict[str, Any]:
        raise NotImplementedError

    def models_path(self, path: str, method: str) -> bool:
        """Is this a model listing / model lookup request?"""
        return False

    def encode_models(self, model_ids: list[str], path: str) -> dict[str, Any]:
        raise NotImplementedError
