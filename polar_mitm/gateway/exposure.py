"""Is the gateway reachable from beyond this machine without a password? (Checked once, when mitmproxy starts.)

mitmproxy listens on every interface by default. The gateway answers model calls from the engine and writes what it
is sent to disk, so an open listener lets anyone on the network use the engine and fill the records. Bind to
loopback (`--listen-host 127.0.0.1`, or `@127.0.0.1:PORT` in a `--mode`), or set mitmproxy's `proxyauth`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    """True for loopback addresses and names; an empty host means every interface (mitmproxy's default)."""
    if not host:
        return False
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: assume it resolves beyond loopback


def exposed_listeners(modes: Sequence[str], listen_host: str, listen_port: int | None = None) -> list[str]:
    """The `mode (host:port)` of each listener that is not bound to loopback."""
    from mitmproxy.proxy.mode_specs import ProxyMode

    exposed = []
    for spec in modes or ["regular"]:
        mode = ProxyMode.parse(spec)
        host = mode.listen_host(listen_host)
        if not is_loopback(host):
            exposed.append(f"{spec} ({host or 'all interfaces'}:{mode.listen_port(listen_port)})")
    return exposed


def exposure_warning(
    modes: Sequence[str], listen_host: str, proxyauth: str | None, listen_port: int | None = None
) -> str | None:
    """The start-up warning, or None when every listener is on loopback or mitmproxy asks for a password."""
    if proxyauth:
        return None
    exposed = exposed_listeners(modes, listen_host, listen_port)
    if not exposed:
        return None
    return (
        f"polar gateway listening beyond loopback without proxyauth: {', '.join(exposed)} — anyone who can "
        "reach it can use the engine and write records. Bind to loopback (--listen-host 127.0.0.1) or set "
        "proxyauth."
    )
