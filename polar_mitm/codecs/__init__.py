"""Provider codecs: one module per API behind one interface (`base.Codec`), picked once by this registry.

The gateway, the rollout and the SDK agent ask the registry, never a provider by name: which codec a model call
is for (`detect`: the request path, then provider headers, then the body's shape — host- and prefix-independent),
which provider a request that is not a model call belongs to (`provider_for`: its aux endpoints and error shape),
and where an SDK's base URL points (`sdk_base_url`).
"""

from __future__ import annotations

from typing import Any

from polar_mitm.codecs.anthropic import AnthropicCodec
from polar_mitm.codecs.base import Codec, GatewayError, HttpAnswer
from polar_mitm.codecs.google import GoogleCodec
from polar_mitm.codecs.openai_chat import OpenAIChatCodec
from polar_mitm.codecs.openai_responses import OpenAIResponsesCodec
from polar_mitm.codecs.responses_compact import ResponsesCompactCodec

CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (AnthropicCodec(), OpenAIChatCodec(), OpenAIResponsesCodec(), GoogleCodec())
}
CODECS[ResponsesCompactCodec.key] = ResponsesCompactCodec()  # Codex's remote compaction (provider: Responses)

# Chat Completions: what OpenAI-compatible clients speak, so its shape answers when nothing tells the provider.
DEFAULT_CODEC: Codec = CODECS["openai_chat"]
# The API the engine itself serves (SGLang's OpenAI-compatible `/v1/chat/completions`).
ENGINE_CODEC: Codec = CODECS["openai_chat"]

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "ENGINE_CODEC",
    "Codec",
    "GatewayError",
    "HttpAnswer",
    "sdk_base_url",
    "by_headers",
    "by_host",
    "by_path",
    "detect",
    "is_compaction_path",
    "provider_for",
    "websocket_codec",
]


def by_path(path: str) -> Codec | None:
    """The codec whose model call `path` is (without host and query), if any."""
    return next((codec for codec in CODECS.values() if codec.matches(path)), None)


def by_host(host: str) -> Codec | None:
    """The provider API served from `host` (a port is ignored), if it is a known provider host."""
    name = host.split(":")[0].lower()
    return next((codec for codec in CODECS.values() if name in codec.hosts), None)


def by_headers(headers: dict[str, str]) -> Codec | None:
    """The provider a request's headers point to, if any (used for aux endpoints and error shapes)."""
    lower = {k.lower() for k in headers}
    if "anthropic-version" in lower or "x-api-key" in lower:
        return CODECS["anthropic"]
    if "x-goog-api-key" in lower or "x-goog-api-client" in lower:
        return CODECS["google"]
    return None


def provider_for(host: str, headers: dict[str, str], path: str, *, reverse: bool) -> Codec | None:
    """The provider of a request that is not (known to be) a model call: by its host, its headers, then a
    count-tokens path. Everything sent to a reverse gateway is for a provider: by the path's shape, else the
    default. None when nothing tells (regular mode)."""
    codec = by_host(host) or by_headers(headers)
    if codec is not None:
        return codec
    codec = next((c for c in CODECS.values() if c.count_tokens_path(path)), None)
    if codec is not None or not reverse:
        return codec
    return next((c for c in CODECS.values() if c.owns_path(path)), DEFAULT_CODEC)


def websocket_codec() -> Codec:
    """The API whose clients open a WebSocket first: its error shape answers an upgrade of unknown provider."""
    return next(codec for codec in CODECS.values() if codec.websocket_first)


def is_compaction_path(path: str) -> bool:
    """Is `path` a remote compaction endpoint (every call there asks for a summary of the conversation)?"""
    return any(codec.compaction and codec.matches(path) for codec in CODECS.values())


def sdk_base_url(provider: str, root: str) -> str:
    """An SDK's base URL for `provider` when its requests go to `root` (a gateway URL with its session prefix)."""
    return root + CODECS[provider].base_url_suffix


def detect(path: str, headers: dict[str, str], body: Any) -> Codec | None:
    """The codec of a model call, or None when the request is not one."""
    codec = by_path(path)
    if codec is not None:
        return codec
    if not isinstance(body, dict):
        return None
    hinted = by_headers(headers)
    if hinted is not None and "messages" in body and hinted.name == "anthropic":
        return hinted
    if "contents" in body:
        return CODECS["google"]
    if "input" in body and "model" in body:
        return CODECS["openai_responses"]
    if "messages" in body and "model" in body:
        return CODECS["anthropic"] if "max_tokens" in body and "system" in body else CODECS["openai_chat"]
    return None
