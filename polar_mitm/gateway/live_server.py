"""Where live answers leave the gateway: a loopback HTTP server inside the mitmproxy process.

mitmproxy 11 streams a response body only when it comes from a server (`flow.response.stream`, set in the
`responseheaders` hook); a response an addon makes in the `request` hook is sent whole. So a live model call is
redirected to this server (127.0.0.1, an ephemeral port, in the same event loop), which writes the answer as it
is generated, and mitmproxy streams it on to the harness chunk by chunk. The hop costs a loopback connection;
the harness, the records and `mitmdump -w` files see the original request (the addon restores it).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from aiohttp import web

from polar_mitm.gateway.live import LiveAnswer

log = logging.getLogger("polar_mitm.live_server")

PATH_PREFIX = "/polar-live/"


class WebResponder:
    """A live answer's responder on an aiohttp request (see `live.Responder`)."""

    def __init__(self, request: web.BaseRequest) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    async def begin(self, status: int, content_type: str, headers: dict[str, str]) -> None:
        self.response = web.StreamResponse(status=status, headers={"content-type": content_type, **headers})
        await self.response.prepare(self.request)

    async def send(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self) -> None:
        if self.response is not None:
            await self.response.write_eof()


class GoneResponder:
    """For an answer whose client is gone before it could be sent: every write fails, so the call is aborted."""

    async def begin(self, status: int, content_type: str, headers: dict[str, str]) -> None:
        raise ConnectionResetError("the client is gone")

    async def send(self, data: bytes) -> None:
        raise ConnectionResetError("the client is gone")

    async def end(self) -> None:
        return None


class LiveServer:
    """Holds live answers until mitmproxy fetches them (`register` → `path_for`), then runs each one."""

    def __init__(self) -> None:
        self._pending: dict[str, LiveAnswer] = {}
        self._runner: web.ServerRunner | None = None
        self._starting: asyncio.Task | None = None  # the one start; every caller awaits it
        self._tasks: set[asyncio.Task] = set()
        self.port = 0

    async def start(self) -> None:
        """Start the loopback server once. Concurrent first calls all wait until it listens: before that `port` is
        0, and a flow sent there gets mitmproxy's 502 (seen as crashed harness sessions in every fresh gateway's
        first wave of streamed calls)."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        self._runner = web.ServerRunner(web.Server(self._handle), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def register(self, answer: LiveAnswer) -> str:
        """A token for `answer`; mitmproxy fetches it at `PATH_PREFIX + token`."""
        token = uuid.uuid4().hex
        self._pending[token] = answer
        return token

    def abandon(self, token: str) -> None:
        """The flow died before mitmproxy fetched the answer: run it against a gone client (recorded `abort`)."""
        answer = self._pending.pop(token, None)
        if answer is not None:
            task = asyncio.get_running_loop().create_task(answer.run(GoneResponder()))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        answer = self._pending.pop(request.path.removeprefix(PATH_PREFIX), None)
        if answer is None:
            return web.Response(status=404, text="polar-mitm: no such live answer")
        responder = WebResponder(request)
        await answer.run(responder)
        if responder.response is None:  # the client left before anything was sent
            return web.Response(status=499)
        return responder.response

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._starting = None
