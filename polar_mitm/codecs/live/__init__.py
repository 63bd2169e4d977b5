"""Live streams: each provider's SSE events written as the engine's deltas arrive (one module per provider API).

`live_stream(codec_name, conv, head)` picks the encoder once per call; the gateway feeds it `Delta`s
(`gateway/live.py`) and finally the finished `Completion`, the same one the non-streamed path encodes.
"""

from __future__ import annotations

from polar_mitm.codecs.live.anthropic import AnthropicLive
from polar_mitm.codecs.live.base import Delta, LiveStream, StreamHead
from polar_mitm.codecs.live.google import GoogleLive
from polar_mitm.codecs.live.openai_chat import OpenAIChatLive
from polar_mitm.codecs.live.openai_responses import OpenAIResponsesLive
from polar_mitm.conversation import Conversation

LIVE_STREAMS: dict[str, type[LiveStream]] = {
    "anthropic": AnthropicLive,
    "openai_chat": OpenAIChatLive,
    "openai_responses": OpenAIResponsesLive,
    "google": GoogleLive,
}

__all__ = ["LIVE_STREAMS", "Delta", "LiveStream", "StreamHead", "live_stream"]


def live_stream(codec_name: str, conv: Conversation, head: StreamHead) -> LiveStream:
    """The live encoder of the provider API `codec_name` for one call."""
    return LIVE_STREAMS[codec_name](conv, head)
