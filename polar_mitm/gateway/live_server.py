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
from typing import Protocol

from aiohttp import web

from polar_mitm.gateway.cancel import CLIENT_GONE, STREAM_RESET
from polar_mitm.gateway.live import Responder

log = logging.getLogger(__name__)

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
        if self.response is None:
            raise RuntimeError("live answer: bytes sent before the status line")
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


class Hosted(Protocol):
    """What the live server runs: a live answer, or a whole call deferred to it (`addons/deferred_call.py`)."""

    async def run(self, out: Responder) -> None: ...

    def stop(self, reason: str) -> None: ...


class LiveServer:
    """Holds answers until mitmproxy fetches them (`register` → `PATH_PREFIX + token`), then runs each one.

    Each answer runs in a task of its own, shielded from the request handler: when the hop's connection goes (the
    harness left, or reset its HTTP/2 stream, which mitmproxy turns into a closed upstream connection) aiohttp
    cancels the handler, the answer is told to stop, and its task still records the call.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Hosted] = {}
        self._running: dict[asyncio.Task, Hosted] = {}
        self._runner: web.ServerRunner | None = None
        self._starting: asyncio.Task | None = None  # the one start; every caller awaits it
        self.port = 0

    async def start(self) -> None:
        """Start the loopback server once. Concurrent first calls all wait until it listens: before that `port` is
        0, and a flow sent there gets mitmproxy's 502 (seen as crashed harness sessions in every fresh gateway's
        first wave of streamed calls)."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        # auto_decompress off: a body read over the hop is decoded by the gateway, within its size limit.
        server = web.Server(self._handle, handler_cancellation=True, auto_decompress=False, access_log=None)
        self._runner = web.ServerRunner(server)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def register(self, answer: Hosted) -> str:
        """A token for `answer`; mitmproxy fetches it at `PATH_PREFIX + token`."""
        token = uuid.uuid4().hex
        self._pending[token] = answer
        return token

    def abandon(self, token: str, reason: str = CLIENT_GONE) -> None:
        """The flow died before mitmproxy fetched the answer: run it stopped, against a gone client (recorded
        `abort`)."""
        answer = self._pending.pop(token, None)
        if answer is not None:
            answer.stop(reason)
            self._spawn(answer, GoneResponder())

    def _spawn(self, answer: Hosted, out: Responder) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(answer.run(out))
        self._running[task] = answer
        task.add_done_callback(self._forget)
        return task

    def _forget(self, task: asyncio.Task) -> None:
        self._running.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("a live answer failed", exc_info=task.exception())

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        answer = self._pending.pop(request.path.removeprefix(PATH_PREFIX), None)
        if answer is None:
            return web.Response(status=404, text="polar-mitm: no such live answer")
        responder = WebResponder(request)
        task = self._spawn(answer, responder)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:  # the hop's connection closed: the answer stops, its task records it
            answer.stop(STREAM_RESET)
            raise
        if responder.response is None:  # the client left before anything was sent
            return web.Response(status=499)
        return responder.response

    @property
    def busy(self) -> int:
        """Answers waiting to be fetched or running."""
        return len(self._pending) + len(self._running)

    async def wait(self, timeout: float) -> None:
        """Until every running answer is done, or `timeout` seconds."""
        if self._running and timeout > 0:
            await asyncio.wait(list(self._running), timeout=timeout)

    def stop_all(self, reason: str) -> None:
        """Stop every answer: the fetched ones abort, the unfetched ones run against a gone client."""
        for token in list(self._pending):
            self.abandon(token, reason)
        for answer in list(self._running.values()):
            answer.stop(reason)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._starting = None
