"""Base-URL calls on the gateway's own HTTP server (aiohttp), not through mitmproxy's reverse mode.

A harness pointed at a base URL needs nothing mitmproxy does: no TLS interception, no CONNECT, no flow to keep. Yet
mitmproxy's own handling of a request costs ~2 ms of CPU per call (benchmarks/bench_gateway.py), more than our
addon. So `polar_base_url_port` serves them here, in the same process and event loop as the addons: the same
`Gateway` (codecs, records, journal, live streaming, token-exact prompts), the same calls in flight (shutdown waits
for them), the same control path. Only the HTTP layer differs; a test sends the same calls through both and compares
the records field by field (tests/gateway/test_base_url_server.py). mitmproxy stays for HTTPS_PROXY interception,
where it is the point, and for `-w` flow files (a base URL that must be saved as flows uses `--mode reverse:`).

As in the addons, the server fails closed (every request is answered here, never forwarded), refuses a head over
the limits with the provider's 431, takes every credential off the request before anything else, and cancels a call
whose client leaves (recorded `abort`), while its task still records it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict, MultiDict

from polar_mitm.codecs.base import HttpAnswer
from polar_mitm.gateway import control, request_head
from polar_mitm.gateway import identity as ident
from polar_mitm.gateway.cancel import CLIENT_GONE, CallCancel
from polar_mitm.gateway.live import LiveAnswer
from polar_mitm.gateway.live_server import WebResponder
from polar_mitm.gateway.service import Gateway, GatewayRequest

log = logging.getLogger(__name__)

PARSER_FIELD_BYTES = 16 << 20  # aiohttp's head limits (see `BaseUrlServer.start`)
PARSER_HEADERS = 1 << 20
ControlAnswer = Callable[
    [bytes], Awaitable[HttpAnswer]
]  # a control call's body → its answer (addons/control_calls)


class Calls(Protocol):
    """The gateway's calls in flight (`addons.core.CallsInFlight`): shutdown waits for them and cancels them."""

    def track(self, task: asyncio.Task) -> None: ...
    def begin(self, flow_id: str, connection: str, cancel: CallCancel) -> None: ...
    def end(self, flow_id: str, connection: str) -> None: ...


class Core(Protocol):
    """What the server reads of the running gateway (`addons.core.GatewayCore`)."""

    gateway: Gateway | None
    closing: bool
    calls: Calls
    control_token: str | None

    @property
    def options(self) -> Any: ...


error = (
    control.refused
)  # a provider-neutral (OpenAI-shaped) error, for a request no codec has been chosen for


def whole(answer: HttpAnswer) -> web.Response:
    headers = {"content-type": answer.content_type, **(answer.headers or {})}
    return web.Response(status=answer.status, body=answer.body, headers=headers)


class BaseUrlServer:
    """Listens at `host:port` and answers every request from the running gateway (`core`)."""

    def __init__(self, core: Core, control_answer: ControlAnswer) -> None:
        self.core, self.control_answer = core, control_answer
        self._runner: web.ServerRunner | None = None
        self._connections: dict[int, tuple[Any, str]] = {}  # id(aiohttp protocol) → (it, its connection id)
        self.port = 0

    async def start(self, host: str | None, port: int) -> None:
        # aiohttp's own head limits far above ours (polar_max_headers, polar_max_header_kb), so a head over ours
        # reaches `_answer` and gets the provider's 431 in the provider's shape, as through mitmproxy (which has
        # no HTTP/1 limit of its own); past aiohttp's, a plain 400.
        server = web.Server(
            self._handle,
            handler_cancellation=True,  # a client that leaves cancels its handler: its call is told to stop
            auto_decompress=False,  # the gateway decodes a body itself, within its size limit
            max_line_size=PARSER_FIELD_BYTES,
            max_field_size=PARSER_FIELD_BYTES,
            max_headers=PARSER_HEADERS,
            access_log=None,  # a handler's own option for a low-level server (the runner's is not passed on)
        )
        self._runner = web.ServerRunner(server, shutdown_timeout=1.0)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, host or None, port, reuse_address=True).start()
        except OSError:
            if host:
                raise
            # Every interface means IPv4 and IPv6; a host (or namespace) without IPv6 gets IPv4's alone.
            await web.TCPSite(self._runner, "0.0.0.0", port, reuse_address=True).start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- one request -----------------------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Fail closed: whatever goes wrong, the request gets an answer from here."""
        try:
            return await self._answer(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a gateway bug is answered, never passed on
            log.exception("unexpected error on %s %s", request.method, request.path)
            return whole(error(500, f"polar-mitm internal error: {exc!r}"))

    async def _answer(self, request: web.BaseRequest) -> web.StreamResponse:
        core = self.core
        options = core.options
        if options is not None:
            excess = request_head.head_excess(
                request.raw_headers, max_count=options.max_headers, max_bytes=options.max_header_kb << 10
            )
            if excess is not None:
                return whole(head_refusal(request, excess))
        headers, query = CIMultiDict(request.headers), MultiDict(request.query)
        credentials = ident.take_credentials(headers, query)
        path = request.raw_path.split("?", 1)[0]
        if core.control_token is not None and path == control.CONTROL_PATH:
            given = headers.pop(control.TOKEN_HEADER, "")
            if request.method != "POST" or not control.authorized(core.control_token, given):
                return whole(control.control_refused())
            # An authorized caller's body, whatever the body limit (aiohttp's `read` stops at 1 MiB).
            body, _ = await read_bounded(request.content, None)
            return whole(await self.control_answer(body))
        gateway = core.gateway
        if gateway is None:
            return whole(error(503, "polar-mitm: the gateway is not configured; nothing is forwarded"))
        if core.closing:
            return whole(error(503, "polar-mitm: the gateway is shutting down"))
        req = await gateway_request(request, headers, query, credentials, path, gateway.config.max_body_bytes)
        req.connection_id = self._connection_id(request)
        return await self._call(request, gateway, req)

    def _connection_id(self, request: web.BaseRequest) -> str:
        """A stable id per client connection (a session without an id of its own is its connection's)."""
        protocol = request.protocol
        known = self._connections.get(id(protocol))
        if known is not None and known[0] is protocol:
            return known[1]
        if len(self._connections) >= 1024:  # forget the closed ones
            self._connections = {k: v for k, v in self._connections.items() if v[0].transport is not None}
        given = str(uuid.uuid4())[:12]
        self._connections[id(protocol)] = (protocol, given)
        return given

    async def _call(
        self, request: web.BaseRequest, gateway: Gateway, req: GatewayRequest
    ) -> web.StreamResponse:
        """Run the call in a task of its own, tracked for shutdown: a client that leaves cancels this handler, and
        the call is told to stop while its task records it."""
        calls, call_id = self.core.calls, uuid.uuid4().hex
        cancel = req.disconnected = CallCancel()
        calls.begin(call_id, req.connection_id, cancel)
        responder = WebResponder(request)
        running = RunningCall(gateway, req, responder)
        task = asyncio.get_running_loop().create_task(running.run())
        calls.track(task)
        try:
            answer = await asyncio.shield(task)
        except asyncio.CancelledError:
            running.stop(CLIENT_GONE)
            raise
        finally:
            if task.done():
                calls.end(call_id, req.connection_id)
            else:
                task.add_done_callback(lambda _: calls.end(call_id, req.connection_id))
        if answer is not None:
            return whole(answer)
        if responder.response is None:  # a live answer whose client left before anything was sent
            return web.Response(status=499)
        return responder.response


class RunningCall:
    """One call's answer: whole (returned) or live (written to `out` as it is generated); `stop` tells either."""

    def __init__(self, gateway: Gateway, req: GatewayRequest, out: WebResponder) -> None:
        self.gateway, self.req, self.out = gateway, req, out
        self.live: LiveAnswer | None = None

    def stop(self, reason: str) -> None:
        if self.req.disconnected is not None:
            self.req.disconnected.cancel(reason)
        if self.live is not None:
            self.live.stop(reason)

    async def run(self) -> HttpAnswer | None:
        """The whole answer, or None once a live answer has been written."""
        answer = await self.gateway.handle(self.req)
        if isinstance(answer, LiveAnswer):
            self.live = answer
            if self.req.disconnected is not None and self.req.disconnected.is_set():
                answer.stop(self.req.disconnected.reason)
            await answer.run(self.out)
            return None
        if answer is None:  # nothing is forwarded from a base URL: refused, as any unanswerable request
            return error(502, "polar-mitm: this request has no answer (refused)")
        return answer


async def read_bounded(content: Any, limit: int | None) -> tuple[bytes, bool]:
    """A request body (an aiohttp `StreamReader`) as it arrives, up to `limit` bytes: (the body, False), or (b"",
    True) once it is past the limit, the rest left unread. `limit` None: no limit."""
    body = bytearray()
    async for chunk in content.iter_any():
        body += chunk
        if limit is not None and len(body) > limit:
            return b"", True
    return bytes(body), False


async def gateway_request(
    request: web.BaseRequest,
    headers: CIMultiDict,
    query: MultiDict,
    credentials: ident.Credentials,
    path: str,
    max_body: int,
) -> GatewayRequest:
    """The request as the gateway sees it, as `addons.model_calls.gateway_request` makes it from a flow: the body
    read up to the gateway's limit (past it: `body_too_large`, the rest not read), text made UTF-8 once."""
    safe = ident.safe_text
    length = request.content_length
    body, too_large = b"", length is not None and length > max_body
    if not too_large:  # a declared length over the limit is refused unread
        body, too_large = await read_bounded(request.content, max_body)
    user = ident.proxy_user(headers.get("proxy-authorization") or credentials.header("proxy-authorization"))
    pairs = [*headers.items(), *credentials.headers]
    return GatewayRequest(
        method=safe(request.method),
        host=safe(request.host.rsplit(":", 1)[0] if not request.host.endswith("]") else request.host),
        path=safe(path),
        query={safe(k): safe(v) for k, v in [*query.items(), *credentials.query]},
        headers={safe(k).lower(): safe(v) for k, v in pairs},
        body=body,
        content_encoding=safe(headers.get("content-encoding", "")),
        mode="reverse",
        proxy_user=safe(user) if user else None,
        connection_id="",  # the server's (`BaseUrlServer._connection_id`)
        body_too_large=too_large,
    )


def head_refusal(request: web.BaseRequest, excess: str) -> HttpAnswer:
    names = (name.decode("latin-1") for name, _ in request.raw_headers)
    return request_head.refusal(request.host, request.raw_path.split("?", 1)[0], names, excess, reverse=True)
