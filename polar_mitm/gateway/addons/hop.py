"""The loopback hop: a flow sent to the live server (live_server.py) instead of upstream, and put back as the
harness sent it once its answer is in, so `mitmdump -w` files and logs show the request, not the hop.

Three kinds of answer go this way: a live answer (streamed as it is generated), a whole call deferred behind the hop
(`deferred_call.py`: HTTP/2, or a body read by the hop), and a refusal decided at the headers
(`request_head.FixedAnswer`), whose body mitmproxy drops as it arrives.
"""

from __future__ import annotations

from typing import Any

from mitmproxy import http

from polar_mitm.codecs.base import HttpAnswer
from polar_mitm.gateway import identity as ident
from polar_mitm.gateway import request_head
from polar_mitm.gateway.live_server import PATH_PREFIX, Hosted, LiveServer


def drop_body(chunk: bytes) -> list[bytes]:
    """A refused body, read as it arrives and never kept (mitmproxy's `request.stream` callable)."""
    return []


class LoopbackHop:
    """The live server and, per flow sent to it, its token, the request as the harness sent it, and its answer."""

    def __init__(self) -> None:
        self.server = LiveServer()
        self._flows: dict[str, tuple[str, dict[str, Any], Any]] = {}  # flow id → (token, request, answer)

    def holds(self, flow: http.HTTPFlow) -> bool:
        """Whether `flow` was sent to the hop (its answer comes from there, never from upstream)."""
        return flow.id in self._flows

    async def send(self, flow: http.HTTPFlow, answer: Hosted, *, keep_body: bool = False) -> None:
        """Send the flow to the live server, which writes the answer as it is generated (see live_server.py)."""
        await self.server.start()
        token = self.server.register(answer)
        req = flow.request
        self._flows[flow.id] = (
            token,
            {
                "scheme": req.scheme,
                "host": req.host,
                "port": req.port,
                "path": req.path,
                "headers": req.headers.copy(),
                "raw_content": req.raw_content,
                "http_version": req.http_version,
            },
            answer,
        )
        req.scheme, req.host, req.port = "http", "127.0.0.1", self.server.port
        req.path = PATH_PREFIX + token
        if req.is_http2 or req.is_http3:  # the hop speaks HTTP/1.1, which wants a Host header
            req.http_version = "HTTP/1.1"
            req.headers["host"] = f"127.0.0.1:{self.server.port}"
        if keep_body:  # the hop reads the body itself (chunked, bounded)
            return
        # The answer is already planned (or refused): no need to copy the prompt over loopback.
        for name in ("content-encoding", "transfer-encoding"):
            req.headers.pop(name, None)
        req.headers["content-length"] = "0"
        req.raw_content = b""

    async def refuse_at_headers(self, flow: http.HTTPFlow, answer: HttpAnswer) -> None:
        """Answer `answer` now, dropping the body as it arrives (never buffered), the head kept out of the way.

        The request goes to the loopback hop with a bare head: its own may be what is refused (aiohttp, behind
        the hop, has limits of its own); the flow keeps its own head, without credentials, for `-w` files.
        """
        ident.take_credentials(flow.request.headers, flow.request.query)  # none of it is needed, none kept
        await self.send(flow, request_head.FixedAnswer(answer))
        flow.request.headers = http.Headers(host=f"127.0.0.1:{self.server.port}", content_length="0")
        flow.request.stream = drop_body

    def take_back(self, flow: http.HTTPFlow) -> Any:
        """The flow's answer is in: its request as the harness sent it, and the answer that was sent (None: the
        flow never went to the hop)."""
        sent = self._flows.pop(flow.id, None)
        if sent is None:
            return None
        _token, original, answer = sent
        restore(flow, original)
        return answer

    def abandon(self, flow: http.HTTPFlow) -> None:
        """The flow failed before its answer was fetched: the answer still runs (and is recorded), to no one."""
        sent = self._flows.pop(flow.id, None)
        if sent is not None:
            token, original, _answer = sent
            self.server.abandon(token)
            restore(flow, original)

    @property
    def busy(self) -> int:
        """Answers waiting to be fetched or running."""
        return self.server.busy

    def stop_all(self, reason: str) -> None:
        self.server.stop_all(reason)

    async def close(self) -> None:
        await self.server.close()


def restore(flow: http.HTTPFlow, original: dict[str, Any]) -> None:
    """The request as the harness sent it (for `mitmdump -w` files and logs)."""
    req = flow.request
    req.scheme, req.host, req.port, req.path = (
        original["scheme"],
        original["host"],
        original["port"],
        original["path"],
    )
    req.headers = original["headers"]
    req.raw_content = original["raw_content"]
    req.http_version = original["http_version"]
