"""Start and stop our own server processes (engine, gateway) for the demo, tests and rollouts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, *, timeout: float = 300.0, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 2xx; fail fast if `proc` dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} came up")
        try:
            if httpx.get(url, timeout=2.0).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up in {timeout:.0f}s")


def start_engine(model: str = "tiny", *, port: int | None = None, log: Path | None = None,
                 extra_args: list[str] | None = None, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`polar-mitm serve` in a child process; returns (process, base URL) once /health answers."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "polar_mitm.cli", "serve", "--model", model, "--port", str(port),
           *(extra_args or [])]
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", timeout=timeout, proc=proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
