"""What runs on each rollout node of a Ray cluster: the `NodeRollout` actor (one gateway and one staged runner per
node) and what it exchanges with the driver (`SessionSpec` in, `SessionOutcome` out).

The actor is pinned to its node by the driver (ray_driver.py). It owns one gateway (mitmdump + our addon, harness ↔
gateway on loopback) writing to `STORAGE/node-NAME/`, and the same staged runner as a local rollout (INIT → READY
buffer → RUN → POST-RUN → teardown), fed one session at a time. A session's outcome goes back when the session is
done, so a node that dies later loses nothing finished.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import children
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig, SessionRun
from polar_mitm.tasks.task_file import Task


@dataclass
class SessionSpec:
    """One session to run, as the driver hands it to a node."""

    task: Task
    index: int
    session_id: str
    attempt: int = 1


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


class StreamingRollout(Rollout):
    """The staged runner fed one session at a time; its worker pools live until `close()`.

    The stage code is the local runner's; only the feeding differs (sessions arrive from the driver) and the
    straggler cut, which the driver decides across nodes (`cut_group`).
    """

    def __init__(self, harness: HarnessSpec, gateway: GatewayEndpoints, config: RolloutConfig) -> None:
        super().__init__([], harness, gateway, replace(config, keep=None))
        self._done: dict[str, asyncio.Future[SessionRun]] = {}
        self._workers: list[asyncio.Task] = []

    def start(self) -> None:
        cfg = self.config
        self._open_stages()
        self._posts = [asyncio.create_task(self._post_worker()) for _ in range(cfg.post_workers)]
        self._runs = [asyncio.create_task(self._run_worker()) for _ in range(cfg.concurrency)]
        self._inits = (
            [asyncio.create_task(self._init_worker()) for _ in range(cfg.init_workers)]
            if self._buffered
            else []
        )
        self._workers = [*self._posts, *self._runs, *self._inits]

    async def submit(self, s: SessionRun) -> SessionRun:
        """Queue a session; returns it once it is torn down (done, failed or cut)."""
        self.sessions.append(s)
        self.groups[s.task.task_id].append(s)
        done = asyncio.get_running_loop().create_future()
        self._done[s.session_id] = done
        self._pending.put_nowait(s)
        return await done

    async def cut_group(self, task_id: str) -> None:
        """The driver's straggler cut: the group's unfinished sessions here stop (marked `cut`)."""
        for other in self.groups[task_id]:
            if other.stage != "done" and not other.cut:
                other.cut = True
                if other.proc is not None and other.stage == "run":
                    await children.stop_group(other.proc)

    async def close(self) -> None:
        """Drain the pools in stage order (each worker ends on a None), as the local runner does at its end."""
        if self._buffered:
            for _ in self._inits:
                self._pending.put_nowait(None)
            await asyncio.gather(*self._inits)
            for _ in self._runs:
                await self._ready.put(None)
        else:
            for _ in self._runs:
                self._pending.put_nowait(None)
        await asyncio.gather(*self._runs)
        for _ in self._posts:
            self._post_queue.put_nowait(None)
        await asyncio.gather(*self._posts)

    async def abort(self) -> None:
        """Stop now: running harnesses are killed (their workers catch the cancellation), workspaces removed."""
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._remove_unfinished_workspaces()

    def _resolve(self, s: SessionRun) -> None:
        done = self._done.pop(s.session_id, None)
        if done is not None and not done.done():
            done.set_result(s)

    async def _teardown(self, s: SessionRun) -> None:
        try:
            await super()._teardown(s)
        finally:
            self._resolve(s)

    async def _fail(self, s: SessionRun, exc: Exception) -> None:
        try:
            await super()._fail(s, exc)
        finally:
            self._resolve(s)


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
        s = await self.rollout.submit(
            SessionRun(task=spec.task, index=spec.index, session_id=spec.session_id)
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
