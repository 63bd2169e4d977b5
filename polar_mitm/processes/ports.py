"""Ports for the servers we start, and waiting until they answer: a free loopback port, an HTTP URL that answers 2xx,
a TCP port that accepts connections — each failing fast when the process that should answer has died.
"""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, *, timeout: float = 300.0, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 2xx; fail fast if `proc` dies."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:  # one client per wait: see gateway.processes.wait_gateway_ready
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode} before {url} came up")
            try:
                if client.get(url).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up in {timeout:.0f}s")


def wait_port(port: int, *, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open in {timeout:.0f}s")
