"""Base-URL calls on the gateway's own server (gateway/base_url_server.py), started with mitmproxy and stopped last.

With `polar_base_url_port` set, base-URL calls never pass through mitmproxy: this addon starts the server when
mitmproxy runs and closes it after `Shutdown` has waited for (or aborted) the calls in flight, which are the same
calls in flight as mitmproxy's, in the same `GatewayCore`.
"""

from __future__ import annotations

import logging

from mitmproxy import ctx

from polar_mitm.gateway.addons.configuration import stop_process
from polar_mitm.gateway.addons.control_calls import control_answer
from polar_mitm.gateway.addons.core import GatewayCore
from polar_mitm.gateway.base_url_server import BaseUrlServer
from polar_mitm.gateway.exposure import is_loopback

log = logging.getLogger(__name__)


class BaseUrlCalls:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.server: BaseUrlServer | None = None

    async def running(self) -> None:
        options = self.core.options
        if options is None or not options.base_url_port or self.server is not None:
            return
        if ctx.options.proxyauth:
            stop_process(
                "polar_base_url_port serves base URLs without mitmproxy's proxyauth: leave it at 0 and use "
                "--mode reverse:… for a base URL a password guards"
            )
        host = ctx.options.listen_host
        self.server = BaseUrlServer(self.core, lambda body: control_answer(self.core, body))
        try:
            await self.server.start(host, options.base_url_port)
        except OSError as exc:
            stop_process(f"polar_base_url_port={options.base_url_port}: cannot listen on it: {exc}")
        if not is_loopback(host):
            log.warning(
                "polar gateway base URL listening beyond loopback (%s:%d): anyone who can reach it can use the "
                "engine and write records. Bind to loopback (--listen-host 127.0.0.1).",
                host or "all interfaces",
                options.base_url_port,
            )

    async def done(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None
