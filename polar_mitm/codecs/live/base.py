"""The interface every live stream encoder implements, and the deltas it consumes.

A live stream is written in three phases: `start` (the provider's preamble, sent once the answer is committed),
`delta` for each piece of the answer as the engine produces it, and `finish` with the finished `Completion`
(closing events, finish reason, usage). `keepalive` fills silences; `fail` reports an error after the status line
went out. Every method returns the bytes to send (possibly none); encoders never do I/O.

Tool calls reach an encoder whole, once the engine's call has closed: the gateway must check a call (a tool the
request offers, arguments that are a JSON object) before a harness may act on it, and Anthropic and Google want
the arguments as one JSON object anyway. Text and reasoning stream as they arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from polar_mitm.codecs.base import GatewayError
from polar_mitm.codecs.common import SSE_KEEPALIVE
from polar_mitm.conversation import Completion, Conversation, ToolCall

DeltaKind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Delta:
    """One piece of the answer: reasoning or visible text as it arrives, or one whole tool call."""

    kind: DeltaKind
    text: str = ""
    call: ToolCall | None = None


@dataclass
class StreamHead:
    """What an encoder knows before the answer is finished."""

    id: str  # the engine's completion id (`chatcmpl-…`), the same the finished Completion carries
    model: str  # the engine's served model
    prompt_tokens: int = 0  # exact when the gateway built the prompt ids (tokens mode); else 0 until the end


class LiveStream:
    """Base class of the live encoders; see the module docstring for the protocol."""

    content_type = "text/event-stream"

    def __init__(self, conv: Conversation, head: StreamHead) -> None:
        self.conv, self.head = conv, head

    def start(self) -> bytes:
        """The provider's opening events (sent once, when the answer is committed)."""
        return b""

    def delta(self, delta: Delta) -> bytes:
        raise NotImplementedError

    def finish(self, completion: Completion) -> bytes:
        """Closing events for the finished answer (the completion the record holds)."""
        raise NotImplementedError

    def keepalive(self) -> bytes:
        return SSE_KEEPALIVE

    def fail(self, error: GatewayError) -> bytes:
        """An error after the answer was committed: the provider's in-stream error event."""
        raise NotImplementedError
