"""Where the rollout service's sessions run: here (`LocalSessions`: one staged runner against the service's
gateways) or on a Ray cluster (`RaySessions`, `serve-rollouts --ray`: one `NodeRollout` actor per rollout node,
each with its own gateway, as `polar-mitm rollout --ray` runs them). The scheduling, the durable results and the
wire format (jobs.py) are the same for both; only these few calls differ.

On Ray a session's records stay on its node (`OUT/flows/node-NAME/`, on that node's disk): its traces are merged
there, by a task pinned to the node, and only the traces travel. A node that dies mid-session makes that session an
ERROR (its partial records stay on the node); the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import RolloutConfig, SessionRun
from polar_mitm.rollout.streaming import StreamingRollout
from polar_mitm.service.models import Trace
from polar_mitm.service.traces import flows_eot, session_traces

logger = logging.getLogger(__name__)


class SessionPool(StreamingRollout):
    """The service's one local runner: a session leaves its lists once it is reported (a service runs for days)."""

    def forget(self, s: SessionRun) -> None:
        with contextlib.suppress(ValueError):
            self.sessions.remove(s)
        group = self.groups.get(s.task.task_id, [])
        with contextlib.suppress(ValueError):
            group.remove(s)
        if not group:
            self.groups.pop(s.task.task_id, None)


class LocalSessions:
    """Sessions in this process's staged runner, against the service's gateways (records under `flows`)."""

    def __init__(self, endpoints: list[GatewayEndpoints], config: RolloutConfig, flows: Path) -> None:
        self.flows, self.places = flows, len(endpoints)
        self.pool = SessionPool(None, endpoints, config)
        self._eot: int | None = None

    def watch(self, on_change: Callable[[SessionRun], None]) -> None:
        """Each session's stage changes as they happen (INIT, RUN, POST-RUN: the service's events)."""
        self.pool.on_session = on_change

    async def start(self) -> None:
        self.pool.start()

    async def run(self, s: SessionRun, harness: HarnessSpec) -> SessionRun:
        return await self.pool.submit(s, harness)

    async def traces(self, s: SessionRun, builder: str) -> list[Trace]:
        return await asyncio.to_thread(self._traces, s, builder)

    def _traces(self, s: SessionRun, builder: str) -> list[Trace]:
        if self._eot is None:
            self._eot = flows_eot(self.flows)
        return session_traces(self.flows, s.session_id, s.reward, builder, self._eot, s.status)

    def forget(self, s: SessionRun) -> None:
        self.pool.forget(s)

    async def cut_group(self, task_id: str) -> None:
        await self.pool.cut_group(task_id)

    async def close(self) -> None:
        await self.pool.abort()


def node_traces(flows: str, session_id: str, reward: float | None, builder: str) -> list[dict[str, Any]]:
    """A session's traces, merged on the node that holds its records (a Ray task pinned there)."""
    folder = Path(flows)
    traces = session_traces(folder, session_id, reward, builder, flows_eot(folder))
    return [trace.model_dump(mode="json") for trace in traces]


class RaySessions:
    """Sessions on a Ray cluster's rollout nodes, the least loaded node first; each node's gateway records to
    `flows/node-NAME/` and samples from its share of `engine_url` (one engine each, or all through the router)."""

    def __init__(
        self,
        address: str,
        *,
        engine_url: str,
        gateway_options: dict[str, str],
        config: RolloutConfig,
        flows: Path,
        work: Path,
    ) -> None:
        self.address, self.engine_url, self.gateway_options = address, engine_url, gateway_options
        self.config, self.flows, self.work = config, flows, work
        self.pool: Any = None  # rollout.ray_driver.RayPool, once started
        self._where: dict[str, Any] = {}  # session id → the node it ran on (for its traces)
        self.places = 0

    def watch(self, on_change: Callable[[SessionRun], None]) -> None:
        """Nodes report a session when it is done: no stage changes to watch."""

    async def start(self) -> None:
        await asyncio.to_thread(self._start)

    def _start(self) -> None:
        from polar_mitm.rollout.ray_driver import RayPool

        # The nodes' runners take each session's harness from its task; the pool's own is never used.
        self.pool = RayPool(self.address, "sdk:openai_chat")
        started = self.pool.begin(
            self.engine_url,
            self.gateway_options,
            self.config,
            self.work,
            lambda node: self.flows / f"node-{node.name}",
        )
        self.places = len(started)
        for name in self.pool.dead_unreported:
            logger.warning("Ray node %s died before its first session: left out", name)
        self.pool.dead_unreported.clear()

    async def run(self, s: SessionRun, harness: HarnessSpec) -> SessionRun:
        import ray

        from polar_mitm.rollout.ray_node import SessionSpec

        live = self.pool.live()
        if not live:
            s.stage, s.status, s.eval_output = "done", "error", "no Ray rollout node is left"
            return s
        node = min(live, key=lambda n: n.load)
        node.load += 1
        self._where[s.session_id] = node
        spec = SessionSpec(s.task, s.index, s.session_id, harness=harness.spec)
        try:
            outcome = await node.actor.run_session.remote(spec)
        except ray.exceptions.RayError as exc:
            node.alive = False
            s.stage, s.status = "done", "error"
            s.eval_output = f"node {node.name} was lost: {type(exc).__name__}"
            return s
        finally:
            node.load -= 1
        s.stage, s.status, s.reward = "done", outcome.status, outcome.reward
        s.exit_code, s.eval_output = outcome.exit_code, outcome.eval_output
        at = 0.0
        for stage in ("init", "run", "post"):
            if stage in outcome.seconds:
                s.spans[stage] = (at, at + outcome.seconds[stage])
                at += outcome.seconds[stage]
        return s

    async def traces(self, s: SessionRun, builder: str) -> list[Trace]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = self._where.get(s.session_id)
        if node is None:
            return []
        pinned = ray.remote(node_traces).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        )
        folder = str(self.flows / f"node-{node.name}")
        rows = await pinned.remote(folder, s.session_id, s.reward, builder)
        return [Trace.model_validate(row) for row in rows]

    def forget(self, s: SessionRun) -> None:
        self._where.pop(s.session_id, None)

    async def cut_group(self, task_id: str) -> None:
        for node in self.pool.live():
            with contextlib.suppress(Exception):
                await node.actor.cut_group.remote(task_id)

    async def close(self) -> None:
        if self.pool is not None:
            await asyncio.to_thread(self.pool.close)
