"""One command in a sandbox from start to end, for callers outside the rollout runner (`polar-mitm harness run`).

The runner keeps its own loop (timeouts, cgroups, the straggler cut); a one-off run needs only the tunnel to live
while the command does, the rlimits, and its exit code.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from polar_mitm.sandbox.base import Sandbox, SessionBox


async def run_in(sandbox: Sandbox, box: SessionBox, argv: list[str], env: dict[str, str], cwd: Path) -> int:
    """Run `argv` in `box` with stdin/stdout/stderr inherited; its exit code."""
    async with sandbox.session(box):
        wrapped, host_env = sandbox.wrap(box, argv, env, cwd)
        limits = box.limits.prlimit_argv() if sandbox.confines else []
        proc = await asyncio.create_subprocess_exec(*limits, *wrapped, cwd=cwd, env=host_env)
        return await proc.wait()


def run_confined(sandbox: Sandbox, box: SessionBox, argv: list[str], env: dict[str, str], cwd: Path) -> int:
    return asyncio.run(run_in(sandbox, box, argv, env, cwd))
