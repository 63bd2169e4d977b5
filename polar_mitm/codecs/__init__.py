"""Provider codecs: one module per API behind one interface (`base.Codec`), picked once by `detect`.

Detection order (Polar's, made host- and prefix-independent): the request path, then provider headers, then the
body's shape.
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

__all__ = ["CODECS", "Codec", "GatewayError", "HttpAnswer", "detect", "by_headers"]


def by_headers(headers: dict[str, str]) -> Codec | None:
    """The provider a request's headers point to, if any (used for aux endpoints and error shapes)."""
    lower = {k.lower() for k in headers}
    if "anthropic-version" in lower or "x-api-key" in lower:
        return CODECS["anthropic"]
    if "x-goog-api-key" in lower or "x-goog-api-client" in lower:
        return CODECS["google"]
    return None


def detect(path: str, headers: dict[str, str], body: Any) -> Codec | None:
    """The codec of a model call, or None when the request is not one."""
    for codec in CODECS.values():
        if codec.matches(path):
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
