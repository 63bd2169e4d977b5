"""Model calls: a flow turned into a `GatewayRequest`, handed to the `Gateway` service, and its answer sent back
whole, live (streamed as it is generated, behind the loopback hop) or, where the gateway passes through, upstream.

Fails closed: a request is forwarded upstream only when the gateway decided so (`polar_passthrough=upstream`,
regular mode, not a model call); any other state (not configured, shutting down, a bug) answers an error. A body the
gateway would buffer past its limit is not buffered: a `Content-Length` over the limit is refused at the headers
(the body is read and dropped as it comes), and a chunked body is read by the loopback hop, which stops at the
limit. Both answer the provider's 413 and are recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from mitmproxy import http
from mitmproxy.proxy.mode_specs import ReverseMode

from polar_mitm.codecs import by_path
from polar_mitm.codecs.base import HttpAnswer
from polar_mitm.gateway import identity as ident
from polar_mitm.gateway.addons.admission import user_of
from polar_mitm.gateway.addons.core import GatewayCore, answer_internal_error, error_answer, make_response
from polar_mitm.gateway.addons.deferred_call import DeferredCall
from polar_mitm.gateway.addons.hop import drop_body
from polar_mitm.gateway.cancel import CallCancel
from polar_mitm.gateway.live import LiveAnswer
from polar_mitm.gateway.service import GatewayRequest


class ModelCalls:
    """Answers every request the earlier addons left: model calls from the engine, the rest per passthrough."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        """A body over the limit, or chunked, goes to the loopback hop now, unless the request may be forwarded."""
        core = self.core
        credentials = core.credentials.get(flow.id)
        if credentials is None or core.is_control(flow):
            return  # refused at its head (admission, control), or the control path's
        if core.gateway is None or core.closing or flow.response is not None:
            return  # `request` answers it
        length, chunked = body_framing(flow.request.headers)
        too_large = length is not None and length > core.gateway.config.max_body_bytes
        if not (too_large or chunked):
            return
        req = gateway_request(flow, credentials, core.proxy_users)
        if not self._answered_here(req):
            return  # may be forwarded: mitmproxy reads it whole, `request` decides
        del core.credentials[flow.id]
        req.body_too_large = too_large
        call = DeferredCall(core, req, read_body=not too_large)
        await core.hop.send(flow, call, keep_body=not too_large)
        if too_large:
            flow.request.stream = drop_body
        else:
            flow.request.stream = True

    async def request(self, flow: http.HTTPFlow) -> None:
        """Fail closed: whatever goes wrong here, the flow gets an answer and never goes upstream unasked."""
        if flow.response is not None:
            return
        try:
            await self._request(flow)
        except Exception as exc:  # a gateway bug must not let the request through to the real provider
            answer_internal_error(flow, exc)
        finally:
            if flow.response is None and not self.core.hop.holds(flow) and not forwarding(flow):
                flow.response = error_answer(502, "polar-mitm: this request has no answer (refused)")

    async def _request(self, flow: http.HTTPFlow) -> None:
        core = self.core
        if core.hop.holds(flow):  # sent to the loopback hop at its headers (requestheaders)
            return
        credentials = core.credentials.pop(flow.id, None) or ident.take_credentials(
            flow.request.headers, flow.request.query
        )
        if core.gateway is None:
            flow.response = error_answer(
                503, "polar-mitm: the gateway is not configured; nothing is forwarded"
            )
            return
        if core.closing:
            flow.response = error_answer(503, "polar-mitm: the gateway is shutting down")
            return
        req = gateway_request(flow, credentials, core.proxy_users)
        if flow.request.is_http2 and is_model_call(req):
            # HTTP/2: a stream reset is invisible to this hook while it runs; behind the loopback hop it
            # closes the hop, which cancels the call (live_server.py).
            await core.hop.send(flow, DeferredCall(core, req))
            return
        answer = await self._handle(flow, req)
        if answer is None:  # passthrough upstream: the real provider needs the credentials
            ident.restore_credentials(flow.request.headers, flow.request.query, credentials)
            flow.metadata["polar_forward"] = True
            return
        if isinstance(answer, LiveAnswer):
            await core.hop.send(flow, answer)
            return
        flow.response = make_response(answer)
        if answer.meta:  # saved with `mitmdump -w`, so `polar-mitm import-flows` can rebuild the records
            flow.metadata.update(answer.meta)

    def client_disconnected(self, client) -> None:
        """Cancel the connection's model calls still running (they are recorded `abort`)."""
        self.core.calls.cancel_connection(client.id)

    def _answered_here(self, req: GatewayRequest) -> bool:
        """Whether the gateway answers `req` whatever its body (it is never forwarded upstream)."""
        gateway = self.core.gateway
        upstream = gateway is not None and gateway.config.passthrough == "upstream"
        return not (req.mode == "regular" and upstream) or is_model_call(req)

    async def _handle(self, flow: http.HTTPFlow, req: GatewayRequest) -> HttpAnswer | LiveAnswer | None:
        """`gateway.handle` as a tracked task, so shutdown can wait for it and cancel it per call."""
        task = asyncio.ensure_future(self._handle_call(flow.id, flow.client_conn, req))
        self.core.calls.track(task)
        return await asyncio.shield(task)

    async def _handle_call(
        self, flow_id: str, client: Any, req: GatewayRequest
    ) -> HttpAnswer | LiveAnswer | None:
        """Run one call with its own cancel, set when its connection closes, its stream resets or at shutdown."""
        calls = self.core.calls
        cancel = req.disconnected = CallCancel()
        connection = client.id
        if client.timestamp_end is not None:  # already gone before its request reached us
            cancel.cancel()
        calls.begin(flow_id, connection, cancel)
        answer: HttpAnswer | LiveAnswer | None = None
        try:
            gateway = self.core.gateway
            answer = await gateway.handle(req) if gateway is not None else None
        finally:
            if isinstance(answer, LiveAnswer):  # it runs on: its cancel stays reachable until it ends
                answer.on_end(lambda: calls.end(flow_id, connection))
            else:
                calls.end(flow_id, connection)
        return answer


def forwarding(flow: http.HTTPFlow) -> bool:
    return bool(flow.metadata.get("polar_forward"))


def is_model_call(req: GatewayRequest) -> bool:
    return req.method == "POST" and by_path(ident.strip_path_prefix(req.path)[0]) is not None


def body_framing(headers: Any) -> tuple[int | None, bool]:
    """(Content-Length if valid, whether the body is chunked) of a request's headers."""
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    try:
        length = int(headers.get("content-length", ""))
    except ValueError:
        length = None
    return (None if chunked or length is None or length < 0 else length), chunked


def gateway_request(
    flow: http.HTTPFlow, credentials: ident.Credentials, proxy_users: Mapping[str, str]
) -> GatewayRequest:
    """The flow as the gateway sees it: credentials put back in (identity reads `polar-…` keys), text made
    UTF-8; the proxy user its own, else its connection's (`proxy_users`, from CONNECT).

    Header and path bytes that are not UTF-8 reach us as lone surrogates, which no JSON encoder or Parquet
    column accepts: they become U+FFFD here, once.
    """
    safe = ident.safe_text
    user = user_of(flow, credentials) or proxy_users.get(flow.client_conn.id)
    # items(multi=True) reads the lines once; items() looks each name up again, over every line (quadratic).
    pairs = [*flow.request.headers.items(multi=True), *credentials.headers]
    headers = {safe(k).lower(): safe(v) for k, v in pairs}
    query = {safe(k): safe(v) for k, v in [*flow.request.query.items(), *credentials.query]}
    return GatewayRequest(
        method=safe(flow.request.method),
        host=safe(flow.request.pretty_host),
        path=safe(flow.request.path.split("?", 1)[0]),
        query=query,
        headers=headers,
        body=flow.request.raw_content or b"",
        content_encoding=safe(flow.request.headers.get("content-encoding", "")),
        mode="reverse" if isinstance(flow.client_conn.proxy_mode, ReverseMode) else "regular",
        proxy_user=safe(user) if user else None,
        connection_id=flow.client_conn.id[:12],
    )
