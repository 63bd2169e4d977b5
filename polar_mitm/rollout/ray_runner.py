"""Rollouts on a Ray cluster: one long-lived gateway per node, sessions scheduled across the nodes.

What runs where:
- **driver** (`polar-mitm rollout|loop --ray ADDRESS`): the schedule, the rewards file, the report. It keeps each
  node fed with `concurrency + ready_buffer` sessions, so every node's READY buffer stays full.
- **each rollout node**: one `NodeRollout` actor pinned to it (hard node affinity). It owns one gateway (mitmdump +
  our addon, harness ↔ gateway on loopback) writing to `STORAGE/node-NAME/`, and the same staged runner as a local
  rollout (INIT → READY buffer → RUN → POST-RUN → teardown), fed one session at a time.

Rollout nodes: the alive nodes that offer the custom resource `polar_rollout` (`ray start --resources
'{"polar_rollout": 1}'`), or every alive node with CPUs when none does.

Faults: a session's outcome (status, reward) reaches the driver when the session is done, so a node that dies
later loses nothing finished; its records were fsynced by its gateway before each answer, and the driver compacts
the dead node's journal afterwards. Sessions unfinished on a dead node run again on another node under a *new*
session id (the lost attempt's partial records get no reward row, so `merge --drop-unrewarded` leaves them out:
nothing is counted twice); after `max_attempts`, or with no node left, they are reported `node_lost` with the
failure reward and their partial records. Ctrl-C/SIGTERM stops every node's harnesses and gateway (journals
compacted) and still writes the rewards of the finished sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from polar_mitm import procs
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig, RolloutSummary, SessionRun
from polar_mitm.rollout.tasks import Task

ROLLOUT_RESOURCE = "polar_rollout"


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
        session_id=s.session_id, task_id=s.task.task_id, index=s.index, status=s.status, reward=s.reward,
        exit_code=s.exit_code, eval_output=s.eval_output[-2000:], node=node, attempt=attempt,
        seconds={stage: s.seconds(stage) or 0.0 for stage in ("init", "run", "post") if stage in s.spans},
        run_span=(wall_clock(run[0]), wall_clock(run[1])) if run else None)


# -- on each node ----------------------------------------------------------------------------------------------


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
        self._inits = [asyncio.create_task(self._init_worker()) for _ in range(cfg.init_workers)] \
            if self._buffered else []
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
                    await procs.stop_group(other.proc)

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
        self.gateway: procs.GatewayProcess | None = None
        self.rollout: StreamingRollout | None = None

    def ping(self) -> str:
        return self.name

    async def begin(self, out_dir: str, engine_url: str, options: dict[str, str], config: RolloutConfig,
                    confdir: str, log_dir: str) -> None:
        """Start this rollout's gateway (writing to `out_dir`) and the runner's pools."""
        await self.end()
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        # Started from the actor's event-loop thread, which lives as long as the actor: the gateway is tied to it,
        # so a killed worker process (its node died, Ctrl-C) takes its gateway down with it.
        self.gateway = procs.start_gateway(engine_url, Path(out_dir), confdir=Path(confdir),
                                           log=Path(log_dir) / f"gateway-{self.name}.log", options=options,
                                           tie_to_parent=True)
        gw = self.gateway
        self.rollout = StreamingRollout(self.harness, GatewayEndpoints(gw.reverse_url, gw.proxy_url,
                                                                       gw.ca_bundle()), config)
        self.rollout.start()

    async def run_session(self, spec: SessionSpec) -> SessionOutcome:
        if self.rollout is None:
            raise RuntimeError(f"node {self.name}: run_session before begin")
        s = await self.rollout.submit(SessionRun(task=spec.task, index=spec.index, session_id=spec.session_id))
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


# -- on the driver ---------------------------------------------------------------------------------------------


class Signalled(Exception):
    """SIGTERM on the driver, raised where it waits (SIGINT raises KeyboardInterrupt there already)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class NodeHandle:
    node_id: str
    name: str
    actor: Any
    alive: bool = True
    load: int = 0
    finished: int = 0


@dataclass
class RayRolloutResult:
    """The rollout's sessions (one per task × index) plus where they ran and what the dead nodes cost."""

    summary: RolloutSummary
    outcomes: list[SessionOutcome]
    node_dirs: dict[str, Path]
    dead_nodes: list[str]
    lost_attempts: list[dict[str, Any]]  # attempts that died with their node (no reward row: never counted)
    interrupted: int | None = None  # the signal that stopped the rollout
    setup_seconds: float = 0.0  # starting and stopping the gateways (compaction), not in the summary's wall time

    def report(self) -> dict[str, Any]:
        per_node = Counter(o.node for o in self.outcomes)
        return {"sessions": len(self.outcomes), "per_node": dict(per_node), "dead_nodes": self.dead_nodes,
                "lost_attempts": self.lost_attempts, "interrupted": self.interrupted,
                "setup_seconds": self.setup_seconds, "outcomes": [asdict(o) for o in self.outcomes]}

    def lines(self) -> list[str]:
        """What the driver prints: sessions per node and, for each dead node, what became of its sessions."""
        per_node = Counter(o.node for o in self.outcomes)
        out = [f"nodes: {', '.join(f'{n} {c} sessions' for n, c in sorted(per_node.items())) or 'no session'}"]
        for node in self.dead_nodes:
            kept = per_node.get(node, 0)
            rerun = [a for a in self.lost_attempts if a["node"] == node and a["then"] == "rerun"]
            failed = [a for a in self.lost_attempts if a["node"] == node and a["then"] == "node_lost"]
            out.append(f"node {node} died: {kept} finished session(s) kept, {len(rerun)} re-run on other nodes "
                       f"({', '.join(a['session_id'] for a in rerun) or '-'}), {len(failed)} reported node_lost")
        return out


def rollout_nodes() -> list[tuple[str, str]]:
    """(node id, name) of the nodes that run sessions: those offering `polar_rollout`, else those with CPUs."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    marked = [n for n in alive if n.get("Resources", {}).get(ROLLOUT_RESOURCE)]
    chosen = marked or [n for n in alive if n.get("Resources", {}).get("CPU")]
    return [(n["NodeID"], f"{n.get('NodeManagerAddress', 'node')}-{n['NodeID'][:8]}") for n in chosen]


class RayPool:
    """The cluster connection and one `NodeRollout` actor per rollout node, kept across loop iterations."""

    def __init__(self, address: str, harness: str, *, ready_timeout: float = 180.0) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if address == "local":  # a throwaway one-node cluster (tests, trying it out)
                ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        nodes = rollout_nodes()
        if not nodes:
            raise RuntimeError(f"the Ray cluster at {address} has no alive node with CPUs or '{ROLLOUT_RESOURCE}'")
        actor_class = ray.remote(NodeRollout)
        self.nodes = [NodeHandle(node_id, name, actor_class.options(
            num_cpus=0, max_concurrency=100_000, max_restarts=0, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(name, harness))
            for node_id, name in nodes]
        ray.get([n.actor.ping.remote() for n in self.nodes], timeout=ready_timeout)

    def live(self) -> list[NodeHandle]:
        return [n for n in self.nodes if n.alive]

    def close(self) -> None:
        """Stop every actor (gateways stopped, journals compacted) and leave the cluster."""
        import ray

        for node in self.live():
            with contextlib.suppress(Exception):
                ray.get(node.actor.abort.remote(), timeout=60)
            with contextlib.suppress(Exception):
                ray.kill(node.actor)
        if self._owns_ray:
            ray.shutdown()

    def rollout(self, tasks: list[Task], config: RolloutConfig, *, out_dir: Path, work_dir: Path, engine_url: str,
                gateway_options: dict[str, str] | None = None, max_attempts: int = 2) -> RayRolloutResult:
        """G sessions per task across the live nodes; records under `out_dir/node-NAME/`."""
        return RayRollout(self, tasks, config, out_dir=out_dir, work_dir=work_dir, engine_url=engine_url,
                          gateway_options=gateway_options or {}, max_attempts=max_attempts).run()


class RayRollout:
    """One rollout on the pool: feeds the nodes, gathers outcomes, survives dead nodes, stops on a signal."""

    def __init__(self, pool: RayPool, tasks: list[Task], config: RolloutConfig, *, out_dir: Path, work_dir: Path,
                 engine_url: str, gateway_options: dict[str, str], max_attempts: int) -> None:
        self.pool, self.config, self.max_attempts = pool, config, max_attempts
        self.out_dir, self.work_dir = Path(out_dir).resolve(), Path(work_dir).resolve()
        self.engine_url, self.gateway_options = engine_url, gateway_options
        self.pending = deque(SessionSpec(t, i, new_session_id(t, i)) for t in tasks for i in range(config.group_size))
        self.inflight: dict[Any, tuple[SessionSpec, NodeHandle]] = {}
        self.outcomes: dict[tuple[str, int], SessionOutcome] = {}
        self.lost: list[dict[str, Any]] = []
        self.dead: list[str] = []
        self.done_per_group: Counter = Counter()
        self.capacity = config.concurrency + max(config.ready_buffer, 0)

    def node_dir(self, node: NodeHandle) -> Path:
        return self.out_dir / f"node-{node.name}"

    def run(self) -> RayRolloutResult:
        import ray

        began = time.monotonic()
        self._begin()
        started = time.monotonic()  # the summary's wall time is the sessions' own; gateway start/stop is setup
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        interrupted, sessions_done = None, None
        try:
            while self.pending or self.inflight:
                self._fill()
                if not self.inflight:
                    break  # nothing can run: no node left (the rest are reported below)
                ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=1.0)
                for ref in ready:
                    self._collect(ref)
            self._fail_unrunnable()
            sessions_done = time.monotonic()
            self._end()
        except (KeyboardInterrupt, Signalled) as stop:
            interrupted = stop.signum if isinstance(stop, Signalled) else signal.SIGINT
            self._abort()
        finally:
            signal.signal(signal.SIGTERM, previous)
            self._compact_dead()
        ended = time.monotonic()
        sessions_done = sessions_done or ended
        result = self._result(sessions_done - started, interrupted)
        result.setup_seconds = (started - began) + (ended - sessions_done)
        return result

    def _on_sigterm(self, signum: int, frame: object) -> None:
        raise Signalled(signum)

    # -- lifecycle of the node actors ------------------------------------------------------------------------------

    def _begin(self) -> None:
        import ray

        from polar_mitm import engines

        refs = []
        live = self.pool.live()
        for node, backend in zip(live, engines.gateway_backends(self.engine_url, len(live)), strict=True):
            node.load = node.finished = 0
            config = replace(self.config, workspace_root=self.work_dir / "workspaces" / node.name,
                             log_dir=self.work_dir / "logs" / node.name, keep=None)
            refs.append(node.actor.begin.remote(str(self.node_dir(node)), backend, self.gateway_options, config,
                                                str(self.work_dir / "mitmproxy" / node.name),
                                                str(self.work_dir / "logs")))
        ray.get(refs, timeout=180)

    def _end(self) -> None:
        import ray

        for node in self.pool.live():
            try:
                ray.get(node.actor.end.remote(), timeout=120)
            except ray.exceptions.RayError:
                self._node_died(node)

    def _abort(self) -> None:
        import ray

        refs = [node.actor.abort.remote() for node in self.pool.live()]
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.get(refs, timeout=60)

    def _compact_dead(self) -> None:
        """A dead node's gateway may have left its journal: compact it into a shard (where the folder is reachable)."""
        from polar_mitm.storage.journal import RecordWriter

        for node in self.pool.nodes:
            folder = self.node_dir(node)
            if not node.alive and folder.is_dir():
                writer = RecordWriter(folder)
                writer.start()  # recovers and compacts the leftover journals
                writer.close()

    # -- scheduling -------------------------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Hand sessions to the least loaded live nodes until each holds concurrency + READY buffer."""
        while self.pending:
            open_nodes = [n for n in self.pool.live() if n.load < self.capacity]
            if not open_nodes:
                return
            node = min(open_nodes, key=lambda n: n.load)
            spec = self.pending.popleft()
            self.inflight[node.actor.run_session.remote(spec)] = (spec, node)
            node.load += 1

    def _collect(self, ref: Any) -> None:
        import ray

        spec, node = self.inflight.pop(ref)
        node.load -= 1
        try:
            outcome = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # our code failed on the node: that session fails, not the run
            outcome = self._failed(spec, node.name, "error", f"node {node.name}: {exc}".splitlines()[0])
        except ray.exceptions.RayError:
            self._node_died(node)
            self._retry_or_fail(spec, node)
            return
        node.finished += 1
        self._record(outcome)

    def _record(self, outcome: SessionOutcome) -> None:
        key = (outcome.task_id, outcome.index)
        if key in self.outcomes:  # cannot happen by construction; refuse to count a sample twice all the same
            raise RuntimeError(f"sample {key} finished twice ({self.outcomes[key].session_id}, {outcome.session_id})")
        self.outcomes[key] = outcome
        if outcome.status != "cut":
            self.done_per_group[outcome.task_id] += 1
            self._maybe_cut(outcome.task_id)

    def _maybe_cut(self, task_id: str) -> None:
        keep = self.config.keep
        if keep is None or self.done_per_group[task_id] < keep:
            return
        for spec in [s for s in self.pending if s.task.task_id == task_id]:
            self.pending.remove(spec)
            self.outcomes[(task_id, spec.index)] = self._failed(spec, "-", "cut", "", reward=None)
        for node in self.pool.live():
            node.actor.cut_group.remote(task_id)

    def _node_died(self, node: NodeHandle) -> None:
        """Mark the node dead and deal with every session it still held."""
        if not node.alive:
            return
        node.alive = False
        self.dead.append(node.name)
        for ref, (spec, holder) in list(self.inflight.items()):
            if holder is node:
                del self.inflight[ref]
                self._retry_or_fail(spec, node)

    def _retry_or_fail(self, spec: SessionSpec, node: NodeHandle) -> None:
        """A session lost with its node: again elsewhere under a new id, or `node_lost` with the failure reward."""
        again = spec.attempt < self.max_attempts and bool(self.pool.live())
        self.lost.append({"session_id": spec.session_id, "task_id": spec.task.task_id, "index": spec.index,
                          "node": node.name, "attempt": spec.attempt, "then": "rerun" if again else "node_lost"})
        if again:
            self.pending.appendleft(SessionSpec(spec.task, spec.index, new_session_id(spec.task, spec.index),
                                                spec.attempt + 1))
        else:
            self._record(self._failed(spec, node.name, "node_lost",
                                      f"node {node.name} died during attempt {spec.attempt}"))

    def _fail_unrunnable(self) -> None:
        """Sessions still pending when no node is left: reported `node_lost` with the failure reward."""
        while self.pending:
            spec = self.pending.popleft()
            self._record(self._failed(spec, "-", "node_lost", "no live rollout node left"))

    def _failed(self, spec: SessionSpec, node: str, status: str, why: str, *,
                reward: float | None | str = "failure") -> SessionOutcome:
        value = self.config.failure_reward if reward == "failure" else reward
        return SessionOutcome(session_id=spec.session_id, task_id=spec.task.task_id, index=spec.index,
                              status=status, reward=value, exit_code=None, eval_output=why, node=node,  # type: ignore
                              attempt=spec.attempt)

    # -- the result ---------------------------------------------------------------------------------------------------

    def _result(self, seconds: float, interrupted: int | None) -> RayRolloutResult:
        outcomes = sorted(self.outcomes.values(), key=lambda o: (o.task_id, o.index))
        sessions = [self._session_run(o) for o in outcomes]
        return RayRolloutResult(RolloutSummary(sessions, seconds, self._utilisation(outcomes)), outcomes,
                                {n.name: self.node_dir(n) for n in self.pool.nodes}, list(self.dead), self.lost,
                                interrupted)

    def _session_run(self, o: SessionOutcome) -> SessionRun:
        task = self._task(o.task_id)
        s = SessionRun(task=task, index=o.index, session_id=o.session_id, stage="done", status=o.status,
                       reward=o.reward, exit_code=o.exit_code, eval_output=o.eval_output)
        s.spans = {stage: (0.0, value) for stage, value in o.seconds.items()}
        return s

    def _task(self, task_id: str) -> Task:
        if not hasattr(self, "_tasks"):
            self._tasks: dict[str, Task] = {}
        return self._tasks.setdefault(task_id, Task(task_id=task_id, prompt=""))

    def _utilisation(self, outcomes: list[SessionOutcome]) -> float:
        spans = [o.run_span for o in outcomes if o.run_span]
        if not spans:
            return 0.0
        window = max(end for _, end in spans) - min(start for start, _ in spans)
        workers = self.config.concurrency * max(len(self.pool.nodes), 1)
        return sum(end - start for start, end in spans) / (workers * window) if window > 0 else 1.0


def write_report(result: RayRolloutResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.report(), indent=2, default=str))


# -- `polar-mitm rollout --ray` ----------------------------------------------------------------------------------


def ray_rollout_command(tasks: list[Task], harness: str, config: RolloutConfig, *, address: str, out: Path,
                        rewards: Path, engine: str | None, model: str, script: Path | None, work_dir: Path,
                        max_attempts: int = 2) -> RayRolloutResult:
    """Start (or attach to) the engines, run the rollout on the cluster, write rewards + `ray_report.json`."""
    from contextlib import ExitStack

    from polar_mitm import engines
    from polar_mitm.rollout.runner import write_rewards

    with ExitStack() as stack:
        engine = stack.enter_context(procs.engine_running(engine, model=model, log=work_dir / "engine.log",
                                                          extra_args=["--script", str(script)] if script else []))
        engine_set = stack.enter_context(engines.attached(engine, log=work_dir / "router.log"))
        pool = RayPool(address, harness)
        stack.callback(pool.close)
        result = pool.rollout(tasks, config, out_dir=out, work_dir=work_dir, engine_url=engine_set.url,
                              gateway_options=engines.gateway_options(engine_set.url), max_attempts=max_attempts)
    write_rewards(result.summary, rewards)
    write_report(result, work_dir / "ray_report.json")
    return result
