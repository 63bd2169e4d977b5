"""Who is calling, and whether the gateway reads on: the first of a request's hooks.

A client connection's proxy user (regular mode) is remembered at its CONNECT, where it carries the session. As soon
as a request's headers are here, a head over the header limits is refused with the provider's 431
(request_head.py), and every other request's credentials leave the flow (identity.py): a request that never
completes (a short or malformed body) reaches `error` and `mitmdump -w` files without `request` ever running.
"""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.proxy.mode_specs import ReverseMode

from polar_mitm.codecs.base import HttpAnswer
from polar_mitm.gateway import identity as ident
from polar_mitm.gateway import request_head
from polar_mitm.gateway.addons.core import GatewayCore


class Admission:
    """Proxy users per connection; head limits and credentials per request (kept in the core for later hooks)."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Regular mode: remember the proxy user (our session carrier) of this client connection."""
        user = user_of(flow)
        if user:
            self.core.proxy_users[flow.client_conn.id] = user
        flow.request.headers.pop("Proxy-Authorization", None)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        """A head over the limits is answered now from behind the hop, its body dropped as it arrives; any other
        request's credentials are taken off it, into the core, for the hooks that need them."""
        options = self.core.options
        if options is not None and flow.response is None:
            excess = request_head.head_excess(
                flow.request.headers.fields,
                max_count=options.max_headers,
                max_bytes=options.max_header_bytes,
            )
            if excess is not None:
                await self.core.hop.refuse_at_headers(flow, head_refusal(flow, excess))
                return
        self.core.credentials[flow.id] = ident.take_credentials(flow.request.headers, flow.request.query)

    def client_disconnected(self, client) -> None:
        self.core.proxy_users.pop(client.id, None)


def head_refusal(flow: http.HTTPFlow, excess: str) -> HttpAnswer:
    req = flow.request
    return request_head.refusal(
        req.pretty_host,
        req.path,
        (name for name, _ in req.headers.items(multi=True)),
        excess,
        reverse=isinstance(flow.client_conn.proxy_mode, ReverseMode),
    )


def user_of(flow: http.HTTPFlow, credentials: ident.Credentials | None = None) -> str | None:
    """The proxy user of a request: mitmproxy's own proxyauth, else its Proxy-Authorization (or the one taken)."""
    auth = flow.metadata.get("proxyauth")  # set when mitmproxy's own proxyauth option is on
    if auth:
        return auth[0] or None
    header = flow.request.headers.get("Proxy-Authorization")
    if header is None and credentials is not None:
        header = credentials.header("proxy-authorization")
    return ident.proxy_user(header)
