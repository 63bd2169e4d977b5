"""Rollout throughput on a Ray cluster, 1 node vs 2 nodes, and the per-session overhead Ray adds over the local
runner — same machine, same run.

A local cluster (ray.cluster_utils.Cluster: a head without CPUs, rollout nodes each with its own raylet and the
`polar_rollout` resource) runs a sleep-based `cmd:` harness, so the CPU is not the limit and the figures measure
scheduling: each node runs its own gateway and staged runner (`polar_mitm.rollout.ray_node`).
Run: .venv/bin/python benchmarks/bench_ray_rollout.py [--sessions 32 --run-seconds 2 --concurrency 4]
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

NO_ENGINE = "http://127.0.0.1:9"  # the harness makes no model call; the gateways still run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--run-seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=4, help="RUN workers per node")
    args = parser.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    from polar_mitm.rollout.ray_driver import RayPool

    small = {"object_store_memory": 80 << 20}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tasks_file = root / "tasks.jsonl"
        tasks_file.write_text(
            "".join(
                json.dumps({"task_id": f"t{i}", "prompt": "p", "eval": {"command": "true"}}) + "\n"
                for i in range(args.sessions // 4)
            )
        )
        tasks, harness = load_tasks(tasks_file), f"cmd:sleep {args.run_seconds}"
        config = RolloutConfig(group_size=4, concurrency=args.concurrency, ready_buffer=args.concurrency)
        n = len(tasks) * 4

        local_config = RolloutConfig(
            group_size=4,
            concurrency=args.concurrency,
            ready_buffer=args.concurrency,
            workspace_root=root / "local",
        )
        local = asyncio.run(
            Rollout(tasks, HarnessSpec(harness), GatewayEndpoints(NO_ENGINE), local_config).run()
        )

        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, **small}
        )
        try:
            cluster.add_node(num_cpus=1, resources={"polar_rollout": 1}, **small)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            walls, setup = {}, {}
            for nodes in (1, 2):
                if nodes == 2:
                    cluster.add_node(num_cpus=1, resources={"polar_rollout": 1}, **small)
                    cluster.wait_for_nodes()
                pool = RayPool(cluster.address, harness)
                try:
                    result = pool.rollout(
                        tasks,
                        config,
                        out_dir=root / f"flows-{nodes}",
                        work_dir=root / f"w{nodes}",
                        engine_url=NO_ENGINE,
                    )
                finally:
                    pool.close()
                assert len(result.summary.sessions) == n and all(
                    s.status == "ok" for s in result.summary.sessions
                )
                walls[nodes] = result.summary.wall_seconds
                setup[nodes] = result.setup_seconds
        finally:
            ray.shutdown()
            cluster.shutdown()

    ideal_one = n / args.concurrency * args.run_seconds
    print(f"{n} sessions, RUN {args.run_seconds:g}s (sleep), {args.concurrency} RUN workers per node")
    print(f"{'runner':<22}{'wall s':>8}{'sessions/min':>14}")
    print(f"{'local (no Ray)':<22}{local.wall_seconds:>8.2f}{n / local.wall_seconds * 60:>14.1f}")
    for nodes, wall in walls.items():
        print(
            f"{f'Ray, {nodes} node(s)':<22}{wall:>8.2f}{n / wall * 60:>14.1f}   (+ {setup[nodes]:.1f}s gateway "
            f"start/stop, once per rollout)"
        )
    print(f"speed-up 2 nodes vs 1: {walls[1] / walls[2]:.2f}x")
    print(
        f"added per session by Ray (1 node vs local, same workers): "
        f"{(walls[1] - local.wall_seconds) / n * 1000:.0f} ms; local runner vs ideal "
        f"{(local.wall_seconds - ideal_one) / n * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
