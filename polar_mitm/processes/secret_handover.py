"""Hand secrets (the gateway's control token, an engine's API key, the session-credential key) to a child process
so that no other process can read them.

A child's environment and command line are readable by every process of the same user (`/proc/PID/environ`
keeps the exec-time block even after Python pops the variable; `/proc/PID/cmdline` likewise). So the parent
writes the secrets, as one JSON object, into a pipe the child inherits; only the pipe's *number* is in the
environment (`POLAR_SECRETS_FD`). The child reads it once at start (`take`), closes it and forgets the number, so
nothing it starts inherits either. What remains open without a sandbox: a process of the same user that can
ptrace (root can) may still read the child's memory — the sandbox issue closes that. Standard library only: vLLM's
launcher (its own venv, polar_mitm/vllm/launcher.py) takes the engine's key through it too.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

FD_ENV = "POLAR_SECRETS_FD"

_taken: dict[str, str] | None = None


class Handover:
    """The parent's side: `Popen(..., **handover.popen_kwargs(env))`, then `handover.close()` after the start."""

    def __init__(self, secrets: dict[str, str | None]) -> None:
        payload = json.dumps({k: v for k, v in secrets.items() if v}).encode()
        self._read_fd, write_fd = os.pipe()
        try:
            if len(payload) > 60_000:  # must fit the pipe's buffer: nothing reads until the child starts
                raise ValueError("secrets too large for a pipe handover")
            os.write(write_fd, payload)
        finally:
            os.close(write_fd)

    def popen_kwargs(self, env: dict[str, str]) -> dict[str, Any]:
        """`env` and `pass_fds` for `subprocess.Popen` (the fd's number in the environment, the fd inherited)."""
        return {"env": {**env, FD_ENV: str(self._read_fd)}, "pass_fds": (self._read_fd,)}

    def close(self) -> None:
        """Close the parent's copy of the read end (the child keeps its own)."""
        with contextlib.suppress(OSError):
            os.close(self._read_fd)


def take(name: str) -> str | None:
    """The secret `name` this process was started with (None when there is none).

    The first call reads the inherited pipe whole and closes it; later calls answer from what it read."""
    global _taken
    if _taken is None:
        _taken = _read_inherited()
    return _taken.get(name)


def _read_inherited() -> dict[str, str]:
    number = os.environ.pop(FD_ENV, None)
    if not number or not number.isdigit():
        return {}
    fd = int(number)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return {}
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    try:
        value = json.loads(b"".join(chunks))
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}
