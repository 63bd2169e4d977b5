"""What runs on each rollout node of a Ray cluster: the `NodeRollout` actor (one gateway and one staged runner per
node) and what it exchanges with the driver (`SessionSpec` in, `SessionOutcome` out).

The actor is pinned to its node by the driver (ray_driver.py). It owns one gateway (mitmdump + our addon, harness ↔
gateway on loopback) writing to `STORAGE/node-NAME/`, and the same staged runner as a local rollout (INIT → READY
buffer → RUN → POST-RUN → teardown), fed one session at a time. A session's outcome goes back when the session is
done, so a node that dies later loses nothing finished.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import RolloutConfig, SessionRun
from polar_mitm.rollout.streaming import StreamingRollout
from polar_mitm.tasks.task_file import Task


@dataclass
class SessionSpec:
    """One session to run, as the driver hands it to a node."""

    task: Task
    index: int
    session_id: str
    attempt: int = 1
    harness: str | None = None  # the session's own harness (the rollout service's tasks), else the node's


@dataclass
class SessionOutcome:
    """What a node reports when a session is done: everything the rewards file and the report need."""

    session_id: str
    task_id: str
    index: int
    status: str
    reward: float | None
    exit_code: int | None
    eval_output: str
    node: str
    attempt: int = 1
    seconds: dict[str, float] = field(default_factory=dict)  # init / run / post
    run_span: tuple[float, float] | None = None  # wall-clock RUN start/end (utilisation across nodes)


def new_session_id(task: Task, index: int) -> str:
    return f"{task.task_id}-{index}-{uuid.uuid4().hex[:8]}"


def wall_clock(monotonic: float) -> float:
    """A time.monotonic() reading as wall-clock time (comparable between nodes of a synchronised cluster)."""
    return time.time() - (time.monotonic() - monotonic)


def outcome_of(s: SessionRun, node: str, attempt: int) -> SessionOutcome:
    run = s.spans.get("run")
    return SessionOutcome(
        session_id=s.session_id,
        task_id=s.task.task_id,
        index=s.index,
        status=s.status,
        reward=s.reward,
        exit_code=s.exit_code,
        eval_output=s.eval_output[-2000:],
        node=node,
        attempt=attempt,
        seconds={stage: s.seconds(stage) or 0.0 for stage in ("init", "run", "post") if stage in s.spans},
        run_span=(wall_clock(run[0]), wall_clock(run[1])) if run else None,
    )


# -- the actor -------------------------------------------------------------------------------------------------


class NodeRollout:
    """One rollout node (a Ray actor pinned to it): its gateway and its streaming staged runner."""

    def __init__(self, name: str, harness: str) -> None:
        self.name, self.harness = name, HarnessSpec(harness)
        self.gateway: gateway_processes.GatewayProcess | None = None
        self.rollout: StreamingRollout | None = None

    def ping(self) -> str:
        return self.name

    async def begin(
        self,
        out_dir: str,
        engine_url: str,
        options: dict[str, str],
        config: RolloutConfig,
        confdir: str,
        log_dir: str,
        engine_key: str | None = None,
    ) -> None:
        """Start this rollout's gateway (writing to `out_dir`) and the runner's pools; `engine_key` is the engine's
        API key, which the gateway gets through a pipe (a Ray task's arguments travel over Ray's own connections,
        never a command line or an environment)."""
        await self.end()
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        # Started from the actor's event-loop thread, which lives as long as the actor: the gateway is tied to it,
        # so a killed worker process (its node died, Ctrl-C) takes its gateway down with it.
        self.gateway = gateway_processes.start_gateway(
            engine_url,
            Path(out_dir),
            confdir=Path(confdir),
            log=Path(log_dir) / f"gateway-{self.name}.log",
            options=options,
            tie_to_parent=True,
            engine_key=engine_key,
            session_key=secrets.token_urlsafe(
                32
            ),  # made here: it never leaves this node's runner and gateway
        )
        gw = self.gateway
        self.rollout = StreamingRollout(self.harness, GatewayEndpoints.of(gw), config)
        self.rollout.start()

    async def run_session(self, spec: SessionSpec) -> SessionOutcome:
        if self.rollout is None:
            raise RuntimeError(f"node {self.name}: run_session before begin")
        harness = HarnessSpec(spec.harness) if spec.harness is not None else None
        s = await self.rollout.submit(
            SessionRun(task=spec.task, index=spec.index, session_id=spec.session_id), harness
        )
        return outcome_of(s, self.name, spec.attempt)

    async def cut_group(self, task_id: str) -> None:
        if self.rollout is not None:
            await self.rollout.cut_group(task_id)

    async def end(self) -> None:
        """Finish the pools and stop the gateway (which compacts its journal into a shard)."""
        if self.rollout is not None:
            await self.rollout.close()
            self.rollout = None
        self._stop_gateway()

    async def abort(self) -> None:
        """Interrupted: kill the running harnesses, then stop the gateway (journal compacted)."""
        if self.rollout is not None:
            await self.rollout.abort()
            self.rollout = None
        self._stop_gateway()

    def _stop_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
