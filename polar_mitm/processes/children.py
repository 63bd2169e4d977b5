"""Stopping the children we start: one process (`stop`), a whole process group (`kill_group`, `stop_group`: a
harness runs in its own session and spawns children), what left the group but carries a harness run's marker
(`kill_marked`), and a child that must not outlive its parent (`die_with_parent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from pathlib import Path


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` (SIGKILL by default) to a process group we started, if anything of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


HARNESS_RUN_ENV = "POLAR_HARNESS_RUN"  # marks a harness run's processes, inherited by all it spawns


def kill_marked(marker: str) -> int:
    """SIGKILL every process whose environment holds `POLAR_HARNESS_RUN=marker`; how many there were.

    What a harness left running outside its process group: Cline's hub daemon starts a session of its own and
    outlives every one-shot run (~240 MB each; a rollout of hundreds of sessions would pile them up). Children
    inherit the variable, so the sweep finds them wherever they moved; processes we cannot read are not ours.
    """
    needle = f"{HARNESS_RUN_ENV}={marker}".encode()
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():  # not Linux: the process group is all we can stop
        return 0
    killed = 0
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed


async def stop_group(proc: asyncio.subprocess.Process, grace: float = 2.0) -> None:
    """SIGTERM the whole process group of `proc` (harnesses spawn children), then SIGKILL after a grace period."""
    if proc.returncode is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        kill_group(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), grace)
            return
        except TimeoutError:
            continue


def die_with_parent() -> None:
    """In a child before exec: SIGTERM it when its parent dies (Linux), so a killed Ray worker leaves no gateway."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
