"""Why a model call stops before its answer is done: one event per call, set by whoever ends it.

A call is cancelled when its client's connection closes, when its HTTP/2 stream is reset (the loopback hop sees the
stream go), or when the gateway shuts down and the grace period is over. Each of these ends the call the same way —
the engine is told to stop and the call is recorded as `abort` with what was sampled — and the record says which.
"""

from __future__ import annotations

import asyncio

CLIENT_GONE = "the client disconnected"
STREAM_RESET = "the client closed its connection or reset its HTTP/2 stream"
SHUTDOWN = "the gateway shut down (SIGTERM) before the call finished within the grace period"


class CallCancel(asyncio.Event):
    """An `asyncio.Event` that remembers why it was set (the first reason wins)."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = CLIENT_GONE

    def cancel(self, reason: str = CLIENT_GONE) -> None:
        if not self.is_set():
            self.reason = reason
            self.set()


def reason_of(event: asyncio.Event | None) -> str:
    """What ended a call (the client's disconnect unless the event says otherwise)."""
    return getattr(event, "reason", CLIENT_GONE)
