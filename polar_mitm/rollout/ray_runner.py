"""Rollouts on a Ray cluster: one long-lived gateway per node, sessions scheduled across the nodes.
`polar-mitm rollout --ray` enters here (`ray_rollout_command`); the node actor is in ray_node.py, the driver's pool
and scheduler in ray_driver.py.

What runs where:
- **driver** (`polar-mitm rollout|loop --ray ADDRESS`): the schedule, the rewards file, the report. It keeps each
  node fed with `concurrency + ready_buffer` sessions, so every node's READY buffer stays full.
- **each rollout node**: one `NodeRollout` actor pinned to it (hard node affinity). It owns one gateway (mitmdump +
  our addon, harness ↔ gateway on loopback) writing to `STORAGE/node-NAME/`, and the same staged runner as a local
  rollout (INIT → READY buffer → RUN → POST-RUN → teardown), fed one session at a time.

Rollout nodes, fault handling (dead nodes, re-runs, `node_lost`) and signals: ray_driver.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from polar_mitm.engines import processes as engine_processes
from polar_mitm.rollout.ray_driver import RayPool, RayRolloutResult, write_report
from polar_mitm.rollout.runner import RolloutConfig, RolloutSummary
from polar_mitm.tasks.task_file import Task


def ray_rollout_command(
    tasks: list[Task],
    harness: str,
    config: RolloutConfig,
    *,
    address: str,
    out: Path,
    rewards: Path,
    engine: str | None,
    model: str,
    script: Path | None,
    work_dir: Path,
    max_attempts: int = 2,
    gateway_options: dict[str, str] | None = None,
    judge: Callable[[RolloutSummary], None] | None = None,
) -> RayRolloutResult:
    """Start (or attach to) the engines, run the rollout on the cluster, write rewards + `ray_report.json`.
    `judge` (tasks with a `judge`) combines the finished sessions' rewards with its scores before they are written:
    the nodes' records and logs are read where they were written (`out/node-*`, `work_dir/logs/NODE`)."""
    from contextlib import ExitStack

    from polar_mitm.engines import router
    from polar_mitm.rollout.runner import write_rewards

    with ExitStack() as stack:
        engine = stack.enter_context(
            engine_processes.engine_running(
                engine,
                model=model,
                log=work_dir / "engine.log",
                extra_args=["--script", str(script)] if script else [],
            )
        )
        engine_set = stack.enter_context(router.attached(engine, log=work_dir / "router.log"))
        pool = RayPool(address, harness)
        stack.callback(pool.close)
        result = pool.rollout(
            tasks,
            config,
            out_dir=out,
            work_dir=work_dir,
            engine_url=engine_set.url,
            gateway_options={**router.gateway_options(engine_set.url), **(gateway_options or {})},
            max_attempts=max_attempts,
        )
    if judge is not None and result.interrupted is None:
        judge(result.summary)
    write_rewards(result.summary, rewards, out)  # the nodes' records say how each session ended
    write_report(result, work_dir / "ray_report.json")
    return result
