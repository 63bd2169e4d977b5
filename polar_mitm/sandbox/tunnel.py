"""The only way out of a sandbox's empty network: its gateway's ports, through Unix sockets (Polar's `uds_tunnel`).

Why: a sandbox has a network namespace of its own with nothing but `lo`, so the engine, the gateway's other
sessions, the rollout service and every other address are simply not there. Each gateway port the session was
given (the reverse listener, the proxy listener) gets a Unix socket in a per-session folder on the host, bound
into the sandbox; inside, `socat` listens on 127.0.0.1 at the same port number and forwards to that socket, and
here an asyncio listener connects each accepted stream to the gateway's real TCP port. So base-URL and
HTTPS_PROXY modes see the URLs they were given, byte for byte, and context fidelity is untouched.

The in-sandbox forwarders start first and the harness only once each of them listens (`launcher_script` waits for
the LISTEN line in /proc/net/tcp), so no first request can race them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

SOCKETS_INSIDE = Path("/run/polar-gateway")  # where the socket folder appears inside the sandbox
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
# A Unix socket's path must fit `sun_path` (108 bytes with its NUL); the longest one we make is
# FOLDER/polar-tunnel-XXXXXXXX/65535.sock. A deep $TMPDIR (a test's tmp_path, a job scheduler's scratch folder)
# passes it, so the folder falls back to a short system one.
SUN_PATH_MAX = 107
LONGEST_SOCKET_TAIL = len("/polar-tunnel-XXXXXXXX/65535.sock")
SHORT_TEMPORARY_DIRS = ("/tmp", "/dev/shm", "/run")


class TunnelError(ValueError):
    """A gateway address a sandbox cannot forward (not on loopback: its URL would not mean the same inside)."""


def gateway_ports(*urls: str | None) -> list[int]:
    """The loopback ports of the gateway URLs a session is given (each once, in order)."""
    ports: list[int] = []
    for url in urls:
        if not url:
            continue
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.hostname not in LOOPBACK_HOSTS:
            raise TunnelError(
                f"gateway {url!r} is not on loopback: a sandboxed session reaches only 127.0.0.1 ports "
                "(run the gateway on this machine, or use --sandbox none)"
            )
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if port not in ports:
            ports.append(port)
    return ports


def socket_name(port: int) -> str:
    return f"{port}.sock"


def socket_folder() -> Path:
    """A new private folder for one session's sockets: under $TMPDIR when the sockets' paths fit there, else under
    the first short system temporary folder that is writable."""
    for base in (tempfile.gettempdir(), *SHORT_TEMPORARY_DIRS):
        if len(base) + LONGEST_SOCKET_TAIL <= SUN_PATH_MAX and Path(base).is_dir():
            with contextlib.suppress(OSError):
                return Path(tempfile.mkdtemp(prefix="polar-tunnel-", dir=base))
    raise TunnelError(
        f"no temporary folder short enough for the sandbox's gateway sockets (TMPDIR={tempfile.gettempdir()!r} "
        f"makes paths over {SUN_PATH_MAX} bytes, and /tmp is not writable): set TMPDIR to a shorter folder"
    )


def launcher_script(ports: list[int], wait_s: float = 10.0) -> str:
    """The bash prologue run inside the sandbox before the harness: one socat per port, then wait until each
    listens (an `0A` LISTEN line for 0100007F:PORT in /proc/net/tcp), then `exec "$@"` (the harness). A forwarder
    that exits (its port refused) or does not listen within `wait_s` ends the session with exit 125 and says so."""
    lines = []
    for i, port in enumerate(ports):
        target = SOCKETS_INSIDE / socket_name(port)
        listen = f"TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr"
        lines.append(f"socat {listen} UNIX-CONNECT:{shlex.quote(str(target))} </dev/null & fw{i}=$!")
    tries = int(wait_s / 0.002)
    for i, port in enumerate(ports):
        line = f"0100007F:{port:04X} 00000000:0000 0A"
        lines.append(
            f"n=0; until grep -q '{line}' /proc/net/tcp; do n=$((n+1)); "
            f"if ! kill -0 $fw{i} 2>/dev/null || [ $n -gt {tries} ]; then "
            f'echo "polar-sandbox: the gateway forwarder for port {port} did not start" >&2; exit 125; fi; '
            "sleep 0.002; done"
        )
    lines.append('exec "$@"')
    return "\n".join(lines)


@dataclass
class GatewayTunnel:
    """The host side for one session: a listener per gateway port on a Unix socket in `folder`."""

    ports: list[int]
    host: str = "127.0.0.1"
    folder: Path = field(default_factory=socket_folder)
    _servers: list[asyncio.AbstractServer] = field(default_factory=list)
    _streams: set[asyncio.Task] = field(default_factory=set)

    async def __aenter__(self) -> GatewayTunnel:
        for port in self.ports:
            path = self.folder / socket_name(port)
            server = await asyncio.start_unix_server(
                lambda r, w, port=port: self._forward(r, w, port), path=str(path)
            )
            self._servers.append(server)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._streams):
            task.cancel()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        shutil.rmtree(self.folder, ignore_errors=True)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._streams.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, port)
        except OSError as exc:
            log.warning("sandbox tunnel: gateway port %d refused: %s", port, exc)
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except asyncio.CancelledError:
            # Only __aexit__ cancels a stream (the session is over); ending normally keeps Python 3.11's unix
            # server from logging the cancelled handler as "Exception in callback" with a traceback.
            pass
        finally:
            for w in (writer, up_writer):
                w.close()
            if task is not None:
                self._streams.discard(task)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until EOF, then half-close the other side (HTTP clients read to the end)."""
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass
