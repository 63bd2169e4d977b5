"""A whole model call run behind the loopback hop rather than inside mitmproxy's `request` hook.

Two kinds of flow go this way (model_calls.py): an HTTP/2 call, so a reset of its stream cancels it, and a call whose
body the hop reads itself (chunked, bounded by the gateway's limit) or refuses unread (over the limit).
"""

from __future__ import annotations

from typing import Any

from polar_mitm.codecs import DEFAULT_CODEC
from polar_mitm.codecs.base import GatewayError, HttpAnswer
from polar_mitm.gateway.addons.core import GatewayCore
from polar_mitm.gateway.base_url_server import read_bounded
from polar_mitm.gateway.cancel import CallCancel
from polar_mitm.gateway.live import LiveAnswer, Responder
from polar_mitm.gateway.service import GatewayRequest


class DeferredCall:
    """A whole model call run behind the loopback hop (HTTP/2 flows), so a reset of its stream cancels it.

    mitmproxy pauses an HTTP/2 stream while an addon hook runs, and queues the stream's reset until the hook
    returns: a call answered inside `request` runs to its end for a client long gone. Behind the hop, mitmproxy
    is waiting on a server instead, and a reset closes that server connection.
    """

    def __init__(self, core: GatewayCore, req: GatewayRequest, *, read_body: bool = False) -> None:
        self.core, self.req, self.read_body = core, req, read_body
        self.cancel = CallCancel()
        self.live: LiveAnswer | None = None
        self.row: dict[str, Any] | None = None

    def stop(self, reason: str) -> None:
        self.cancel.cancel(reason)
        if self.live is not None:
            self.live.stop(reason)

    async def run(self, out: Responder) -> None:
        if self.read_body:
            request = getattr(out, "request", None)
            if request is None:  # the client left before the hop was reached: nothing to read
                self.req.disconnected = self.cancel
                self.cancel.cancel()
            else:
                await self._read_body(request)
        if self.core.gateway is None:
            answer: HttpAnswer | LiveAnswer | None = None
        else:
            self.req.disconnected = self.cancel
            answer = await self.core.gateway.handle(self.req)
        if isinstance(answer, LiveAnswer):
            self.live = answer
            if self.cancel.is_set():
                answer.stop(self.cancel.reason)
            await answer.run(out)
            self.row = answer.row
            return
        if answer is None:  # cannot be forwarded from behind the hop: refused, as any unanswerable request
            answer = DEFAULT_CODEC.encode_error(
                GatewayError("internal", "polar-mitm: this request has no answer")
            )
        self.row = (answer.meta or {}).get("polar_record")
        try:
            await out.begin(
                answer.status,
                answer.content_type,
                {**(answer.headers or {}), "content-length": str(len(answer.body))},
            )
            await out.send(answer.body)
            await out.end()
        except (ConnectionError, OSError, RuntimeError):
            pass  # the client is gone; the call is recorded already

    async def _read_body(self, request: Any) -> None:
        """The body as it arrives over the hop, up to the gateway's limit (past it: refused, rest not read)."""
        limit = self.core.gateway.config.max_body_bytes if self.core.gateway is not None else 0
        self.req.body, too_large = await read_bounded(request.content, limit)
        self.req.body_too_large = self.req.body_too_large or too_large
