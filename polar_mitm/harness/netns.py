"""A private, loopback-only network namespace, so a harness setting we missed can never reach the internet.

A holder process (`unshare --net … sleep`) keeps the namespace alive; the engine, the gateway and each harness
join it with `nsenter`, so they talk over the namespace's own 127.0.0.1 and nothing else exists. Ports are
checked through `/proc/<holder>/net/tcp*` (which show that namespace's sockets) because the caller itself stays
outside. As root `unshare -n` suffices; otherwise a user namespace is created too (`unshare -rn`), where the
kernel allows unprivileged user namespaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

READY = "polar-netns-ready"


class NamespaceUnavailable(RuntimeError):
    """This machine cannot create a private network namespace (no unshare/nsenter/ip, or not permitted)."""


class LoopbackNamespace:
    """A network namespace with only `lo` (up). Use as a context manager; `wrap` runs a command inside it."""

    def __init__(self) -> None:
        self.holder: subprocess.Popen | None = None
        self.user_ns = os.geteuid() != 0
        self.ports_given: set[int] = set()  # ports handed to processes in here (free_port)

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> LoopbackNamespace:
        missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
        if missing:
            raise NamespaceUnavailable(f"missing {', '.join(missing)} (util-linux, iproute2)")
        flags = ["--user", "--map-root-user", "--net"] if self.user_ns else ["--net"]
        script = f"ip link set lo up && echo {READY} && exec sleep infinity"
        self.holder = subprocess.Popen(
            ["unshare", *flags, "--", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        assert self.holder.stdout is not None
        line = self._read_line(timeout)
        if line.strip() != READY:
            err = self.holder.stderr.read() if self.holder.poll() is not None and self.holder.stderr else ""
            self.close()
            raise NamespaceUnavailable(f"unshare failed: {(line + err).strip() or 'no answer'}")
        return self

    def _read_line(self, timeout: float) -> str:
        import selectors

        assert self.holder is not None and self.holder.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.holder.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                return ""
        return self.holder.stdout.readline()

    def close(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait()
        self.holder = None

    def __enter__(self) -> LoopbackNamespace:
        return self.start() if self.holder is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- use ----------------------------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self.holder is None or self.holder.poll() is not None:
            raise NamespaceUnavailable("the namespace holder is not running")
        return self.holder.pid

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace (same user, same files, only the network differs)."""
        ns = f"/proc/{self.pid}/ns"
        join = [f"--user={ns}/user", "--preserve-credentials"] if self.user_ns else []
        return ["nsenter", *join, f"--net={ns}/net", "--", *argv]

    def namespace_files(self) -> list[str]:
        """The /proc/PID/ns files a process joins (in this order) to be where `wrap` puts it."""
        ns = f"/proc/{self.pid}/ns"
        return [f"{ns}/user", f"{ns}/net"] if self.user_ns else [f"{ns}/net"]

    def listening(self, port: int) -> bool:
        """Is a TCP socket listening on `port` inside the namespace?"""
        for table in ("tcp", "tcp6"):
            path = Path(f"/proc/{self.pid}/net/{table}")
            if not path.exists():
                continue
            for row in path.read_text().splitlines()[1:]:
                fields = row.split()
                if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return True
        return False

    def free_port(self) -> int:
        """A port for a process in here. A port free on the host may be taken in here: the engine's port is bound
        only in here, so the host hands it out again (a gateway once failed to start on its engine's port). It is
        one the host has free, not handed to another process here, and not listening in here."""
        from polar_mitm.processes import ports

        while True:
            port = ports.free_port()
            if port not in self.ports_given and not self.listening(port):
                self.ports_given.add(port)
                return port

    def wait_port(self, port: int, *, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
        """Wait until `port` listens inside the namespace; fail fast if `proc` dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
            if self.listening(port):
                return
            time.sleep(0.05)
        raise TimeoutError(f"port {port} did not open in the namespace in {timeout:.0f}s")


def try_namespace() -> tuple[LoopbackNamespace | None, str]:
    """A started namespace, or None and the reason it cannot be had here."""
    try:
        return LoopbackNamespace().start(), "private network namespace (loopback only)"
    except (NamespaceUnavailable, OSError) as exc:
        return None, f"no network namespace ({exc}); isolation by environment only"
