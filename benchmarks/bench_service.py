"""The rollout service's overhead over the in-process runner, side by side in one run.

The same sessions both ways: `--sessions` sessions of a `cmd:` harness that sleeps `--sleep` seconds (so the
harness, not the model, sets the pace), `--group` per task, `--concurrency` at once. In-process: the staged runner
(`Rollout`, what `polar-mitm rollout` runs) against a gateway. Service: `polar-mitm serve-rollouts` on the same
machine, every task submitted at once over HTTP with our `Client` (`run`: `submit_many`, each task told finished by
`/events`).
The two take turns `--repeats` times. Reported (medians): the wall time of all sessions, sessions/s, the time to the
first finished result, the added time per session, and their ratios to the in-process run. Then the same tasks
through a service that is killed (SIGKILL, its whole process group) once about half the sessions finished and
started again with `--resume`: the sessions lost, the ones reported twice, and the sample indices given twice within
a task (all three must be 0).

    .venv/bin/python benchmarks/bench_service.py [--sessions 256] [--group 4] [--concurrency 64] [--sleep 0.5] \\
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from polar_mitm.processes import ports
from polar_mitm.rollout.cli import capture_stack
from polar_mitm.rollout.harness_spec import HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig
from polar_mitm.service.client import Client
from polar_mitm.service.task_requests import line_to_request
from polar_mitm.tasks.task_file import parse_task

TOKEN = "bench-token"


def lines(sessions: int, group: int) -> list[dict]:
    return [
        {"task_id": f"t{k}", "prompt": "p", "eval": "true", "timeouts": {"run": 120}}
        for k in range(max(sessions // group, 1))
    ]


def in_process(args, work: Path) -> dict[str, float]:
    work.mkdir(parents=True)
    tasks = [parse_task(line, work) for line in lines(args.sessions, args.group)]
    config = RolloutConfig(
        group_size=args.group,
        concurrency=args.concurrency,
        ready_buffer=0,
        workspace_root=work / "workspaces",
        log_dir=work / "logs",  # as `polar-mitm rollout` and the service keep each harness's output
    )
    first: list[float] = []
    with capture_stack(
        work / "flows",
        engine=None,
        model="tiny",
        script=None,
        gateway_url=None,
        gateway_proxy=None,
        ca_bundle=None,
        work=work,
    ) as (endpoints, _):
        rollout = Rollout(tasks, HarnessSpec(f"cmd:sleep {args.sleep}"), endpoints, config)
        started = time.perf_counter()

        def on_update(
            sessions,
        ):  # the first whole group, as the service reports a task once all of it is done
            if not first and any(all(s.stage == "done" for s in group) for group in rollout.groups.values()):
                first.append(time.perf_counter() - started)

        rollout.on_update = on_update
        summary = asyncio.run(rollout.run())
        wall = time.perf_counter() - started
    assert len(summary.sessions) == len(tasks) * args.group
    return {"wall": wall, "first": first[0], "sessions": len(summary.sessions)}


def start_service(args, work: Path, port: int, *extra: str) -> subprocess.Popen:
    """`serve-rollouts` in a process group of its own, once its /health answers."""
    env = {**os.environ, "POLAR_SERVICE_TOKEN": TOKEN}
    argv = [sys.executable, "-m", "polar_mitm.cli", "serve-rollouts", "--out", str(work), "--port", str(port)]
    argv += ["--max-sessions", str(args.concurrency), "--queue-limit", str(args.sessions), *extra]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    while True:
        assert proc.poll() is None, f"serve-rollouts exited {proc.returncode}"
        try:
            answer = httpx.get(
                f"http://127.0.0.1:{port}/health", headers={"authorization": f"Bearer {TOKEN}"}
            )
            if answer.status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)


def sleep_requests(args) -> list:
    return [
        line_to_request(line, f"cmd:sleep {args.sleep}", num_samples=args.group)
        for line in lines(args.sessions, args.group)
    ]


def via_service(args, work: Path) -> dict[str, float]:
    port = ports.free_port()
    proc = start_service(args, work, port)
    url = f"http://127.0.0.1:{port}"
    try:
        requests = sleep_requests(args)
        with Client(url, token=TOKEN) as client:
            started = time.perf_counter()
            first, done = None, 0
            for status in client.run(requests):
                first = first or time.perf_counter() - started
                done += status.completed_sessions
            wall = time.perf_counter() - started
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    return {"wall": wall, "first": first or 0.0, "sessions": done}


def killed_and_resumed(args, work: Path) -> dict[str, int]:
    """Every task submitted, SIGKILL once half the sessions finished, `--resume`, every task waited for: what was
    lost, reported twice, or given a sample index twice."""
    port, requests = ports.free_port(), sleep_requests(args)
    url, expected = f"http://127.0.0.1:{port}", len(requests) * args.group
    proc = start_service(args, work, port)
    try:
        with Client(url, token=TOKEN) as client:
            client.submit_many(requests)
            while sum(client.status(r.task_id).completed_sessions for r in requests) < expected // 2:
                time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc = start_service(args, work, port, "--resume")
        with Client(url, token=TOKEN) as client:
            statuses = [client.wait(r.task_id, timeout=600) for r in requests]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    ids = [result.session_id for status in statuses for result in status.results]
    indices = [
        len(status.results) - len({r.metadata["sample_index"] for r in status.results}) for status in statuses
    ]
    return {
        "sessions": len(ids),
        "lost": expected - len(set(ids)),
        "twice": len(ids) - len(set(ids)),
        "indices twice": sum(indices),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sleep", type=float, default=0.5)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="in-process and service runs, taken in turn; medians are printed",
    )
    args = parser.parse_args()
    bases, serveds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):  # in turn, so that a busier stretch of the machine falls on both
            bases.append(in_process(args, Path(tmp) / f"in-process-{k}"))
            serveds.append(via_service(args, Path(tmp) / f"service-{k}"))
        resumed = killed_and_resumed(args, Path(tmp) / "killed")
    base = {key: statistics.median(run[key] for run in bases) for key in bases[0]}
    served = {key: statistics.median(run[key] for run in serveds) for key in serveds[0]}
    print(
        f"{args.sessions} sessions ({args.group} per task), {args.concurrency} at once, each `sleep {args.sleep}`; "
        f"medians of {args.repeats} runs each way"
    )
    print(f"{'':24}{'in-process':>12}{'service':>12}{'ratio':>8}")
    for name, key in (("wall (s)", "wall"), ("first group (s)", "first")):
        print(f"{name:24}{base[key]:12.2f}{served[key]:12.2f}{served[key] / base[key]:8.2f}")
    rate_base, rate_served = base["sessions"] / base["wall"], served["sessions"] / served["wall"]
    print(f"{'sessions/s':24}{rate_base:12.1f}{rate_served:12.1f}{rate_served / rate_base:8.2f}")
    pairs = sorted(b["wall"] / s["wall"] for b, s in zip(bases, serveds, strict=True))
    print(f"sessions/s ratio of each pair of runs: {', '.join(f'{r:.2f}' for r in pairs)} (the goal: ≥ 0.95)")
    added_ms = (served["wall"] - base["wall"]) / args.sessions * 1000
    print(
        f"added per session: {added_ms:+.1f} ms (the goal: ≤ 5 ms); sessions: {base['sessions']} / {served['sessions']}"
    )
    print(
        f"kill -9 at half, --resume: {resumed['sessions']} sessions reported, {resumed['lost']} lost, "
        f"{resumed['twice']} reported twice, {resumed['indices twice']} sample indices given twice"
    )


if __name__ == "__main__":
    main()
