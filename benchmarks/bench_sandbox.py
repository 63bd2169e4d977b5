"""Sandbox start per session: `true` run plain, in bwrap (a session's full argv: every bind, tmpfs, namespaces), and
in bwrap with the gateway tunnel (socat listening inside before the harness starts) — median ms of N starts and the
ratio to a plain exec. Target: a bwrap session starts within 50 ms. Run: .venv/bin/python benchmarks/bench_sandbox.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from polar_mitm.sandbox import SessionBox, get_sandbox


async def start_ms(argv: list[str], env: dict[str, str] | None, n: int) -> float:
    """Median wall ms from spawn to exit of `argv`, over n runs."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(*argv, env=env)
        await proc.wait()
        assert proc.returncode == 0, argv
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def measure(n: int) -> dict[str, float]:
    sandbox = get_sandbox("bwrap")
    with tempfile.TemporaryDirectory() as tmp:
        workspace = Path(tmp) / "ws"
        workspace.mkdir()
        plain = await start_ms(["true"], None, n)
        box = SessionBox(workspace)
        argv, env = sandbox.wrap(box, ["true"], {"PATH": "/usr/bin:/bin"}, workspace)
        bwrap = await start_ms(argv, env, n)
        tunnelled = SessionBox(workspace, ports=[18481, 18480])  # base-URL and proxy listeners
        async with sandbox.session(tunnelled):
            argv, env = sandbox.wrap(tunnelled, ["true"], {"PATH": "/usr/bin:/bin"}, workspace)
            tunnel = await start_ms(argv, env, n)
    return {"plain exec": plain, "bwrap": bwrap, "bwrap + gateway tunnel": tunnel}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=50, help="starts per row")
    args = parser.parse_args()
    results = asyncio.run(measure(args.n))
    base = results["plain exec"]
    print(f"{'start of one session':<26}{'median ms':>10}{'x plain':>9}")
    for label, ms in results.items():
        print(f"{label:<26}{ms:>10.1f}{ms / base:>9.1f}")


if __name__ == "__main__":
    main()
