"""RUN-stage utilisation and wall time with and without the READY buffer, for a batch with a slow INIT; then the
same batch with --sandbox none and bwrap side by side (the sandbox's cost per rollout).

INIT (workspace preparation: copy, clone, setup) and RUN (the harness session) are simulated with sleeps of fixed
length so the figures measure the pipeline itself. Run: .venv/bin/python benchmarks/bench_rollout.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig
from polar_mitm.tasks.task_file import load_tasks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--init-seconds", type=float, default=1.0)
    parser.add_argument("--run-seconds", type=float, default=1.0)
    parser.add_argument("--sandbox", default="bwrap", help="the sandbox of the READY-buffer rows")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tasks_file = root / "tasks.jsonl"
        tasks_file.write_text(
            "".join(
                json.dumps(
                    {
                        "task_id": f"t{i}",
                        "prompt": "p",
                        "workspace": {"setup": [f"sleep {args.init_seconds}"]},
                        "eval": {"command": "true"},
                    }
                )
                + "\n"
                for i in range(args.tasks)
            )
        )
        tasks = load_tasks(tasks_file)
        harness = HarnessSpec(f"cmd:sleep {args.run_seconds}")
        endpoints = GatewayEndpoints("http://127.0.0.1:9")
        n = args.tasks * args.group_size
        print(
            f"{n} sessions, INIT {args.init_seconds}s, RUN {args.run_seconds}s, {args.concurrency} RUN workers"
        )
        print(f"{'pipeline':<34}{'wall s':>8}{'RUN utilisation':>18}")
        results = {}
        for label, cfg in [
            ("no READY buffer (init inline)", dict(ready_buffer=0)),
            ("READY buffer 4, 4 INIT workers", dict(ready_buffer=4, init_workers=4)),
            ("READY buffer 8, 8 INIT workers", dict(ready_buffer=8, init_workers=8)),
        ]:
            config = RolloutConfig(
                group_size=args.group_size,
                concurrency=args.concurrency,
                workspace_root=root / label.replace(" ", "_"),
                sandbox=args.sandbox,
                **cfg,
            )
            summary = asyncio.run(Rollout(tasks, harness, endpoints, config).run())
            results[label] = summary
            print(f"{label:<34}{summary.wall_seconds:>8.1f}{summary.run_utilisation:>17.0%}")
        base = results["no READY buffer (init inline)"]
        best = results["READY buffer 8, 8 INIT workers"]
        print(f"speed-up with the READY buffer: {base.wall_seconds / best.wall_seconds:.2f}x")
        walls = {}
        for sandbox in ("none", "bwrap"):
            config = RolloutConfig(
                group_size=args.group_size,
                concurrency=args.concurrency,
                workspace_root=root / f"sandbox-{sandbox}",
                ready_buffer=8,
                init_workers=8,
                sandbox=sandbox,
            )
            walls[sandbox] = asyncio.run(Rollout(tasks, harness, endpoints, config).run()).wall_seconds
            print(f"{'--sandbox ' + sandbox:<34}{walls[sandbox]:>8.1f}")
        print(f"bwrap / none wall time: {walls['bwrap'] / walls['none']:.3f}x")


if __name__ == "__main__":
    main()
