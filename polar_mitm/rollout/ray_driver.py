"""The driver's side of a Ray rollout: the cluster connection and one `NodeRollout` actor per rollout node
(`RayPool`), and the scheduler that feeds them and survives dead nodes (`RayRollout`).

The driver keeps each node fed with `concurrency + ready_buffer` sessions, so every node's READY buffer stays full.
Rollout nodes: the alive nodes that offer the custom resource `polar_rollout` (`ray start --resources
'{"polar_rollout": 1}'`), or every alive node with CPUs when none does.

Faults: a dead node's records were fsynced by its gateway before each answer, and the driver compacts its journal
afterwards. Sessions unfinished on a dead node run again on another node under a *new* session id (the lost
attempt's partial records get no reward row, so `merge --drop-unrewarded` leaves them out: nothing is counted
twice); after `max_attempts`, or with no node left, they are reported `node_lost` with the failure reward and their
partial records. Ctrl-C/SIGTERM stops every node's harnesses and gateway (journals compacted) and still returns the
finished sessions.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from polar_mitm.rollout.ray_node import NodeRollout, SessionOutcome, SessionSpec, new_session_id
from polar_mitm.rollout.runner import RolloutConfig, RolloutSummary, SessionRun
from polar_mitm.tasks.task_file import Task

ROLLOUT_RESOURCE = "polar_rollout"


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
    setup_seconds: float = (
        0.0  # starting and stopping the gateways (compaction), not in the summary's wall time
    )

    def report(self) -> dict[str, Any]:
        per_node = Counter(o.node for o in self.outcomes)
        return {
            "sessions": len(self.outcomes),
            "per_node": dict(per_node),
            "dead_nodes": self.dead_nodes,
            "lost_attempts": self.lost_attempts,
            "interrupted": self.interrupted,
            "setup_seconds": self.setup_seconds,
            "outcomes": [asdict(o) for o in self.outcomes],
        }

    def lines(self) -> list[str]:
        """What the driver prints: sessions per node and, for each dead node, what became of its sessions."""
        per_node = Counter(o.node for o in self.outcomes)
        out = [
            f"nodes: {', '.join(f'{n} {c} sessions' for n, c in sorted(per_node.items())) or 'no session'}"
        ]
        for node in self.dead_nodes:
            kept = per_node.get(node, 0)
            rerun = [a for a in self.lost_attempts if a["node"] == node and a["then"] == "rerun"]
            failed = [a for a in self.lost_attempts if a["node"] == node and a["then"] == "node_lost"]
            out.append(
                f"node {node} died: {kept} finished session(s) kept, {len(rerun)} re-run on other nodes "
                f"({', '.join(a['session_id'] for a in rerun) or '-'}), {len(failed)} reported node_lost"
            )
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
                ray.init(
                    num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False
                )
            else:
                ray.init(address=address, log_to_driver=False)
        nodes = rollout_nodes()
        if not nodes:
            raise RuntimeError(
                f"the Ray cluster at {address} has no alive node with CPUs or '{ROLLOUT_RESOURCE}'"
            )
        actor_class = ray.remote(NodeRollout)
        self.nodes = [
            NodeHandle(
                node_id,
                name,
                actor_class.options(
                    num_cpus=0,
                    max_concurrency=100_000,
                    max_restarts=0,
                    max_task_retries=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                ).remote(name, harness),
            )
            for node_id, name in nodes
        ]
        # Ray lists a node that just died as alive until its heartbeats stop (~16 s): an actor placed there dies
        # unstarted. That node is left out (and reported), as a node dying mid-rollout is; only none left fails.
        self.dead_unreported: list[str] = []
        self._settle({n.actor.ping.remote(): n for n in self.nodes}, timeout=ready_timeout)
        if not self.live():
            raise RuntimeError(
                f"every rollout node of the Ray cluster at {address} died before its actor started "
                f"({', '.join(self.dead_unreported)})"
            )

    def live(self) -> list[NodeHandle]:
        return [n for n in self.nodes if n.alive]

    def _settle(self, refs: dict[Any, NodeHandle], *, timeout: float) -> None:
        """Wait for one call per node; a node whose actor died (with its node) is marked dead, to be reported by
        the next rollout. A failure in our own code on a node, or a timeout, is raised as before."""
        import ray

        deadline = time.monotonic() + timeout
        for ref, node in refs.items():
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError):
                raise
            except ray.exceptions.RayError:
                node.alive = False
                self.dead_unreported.append(node.name)

    def begin(
        self,
        engine_url: str,
        gateway_options: dict[str, str],
        config: RolloutConfig,
        work_dir: Path,
        node_dir: Callable[[NodeHandle], Path],
    ) -> list[NodeHandle]:
        """Start each live node's gateway (recording to `node_dir(node)`, on its share of `engine_url`) and its
        runner (workspaces and logs under `work_dir`, per node); the nodes started."""

        from polar_mitm.engines import keys as engine_keys
        from polar_mitm.engines import router

        refs = {}
        live = self.live()
        for node, backend in zip(live, router.gateway_backends(engine_url, len(live)), strict=True):
            node.load = node.finished = 0
            node_config = replace(
                config,
                workspace_root=work_dir / "workspaces" / node.name,
                log_dir=work_dir / "logs" / node.name,
                keep=None,
            )
            ref = node.actor.begin.remote(
                str(node_dir(node)),
                backend,
                gateway_options,
                node_config,
                str(work_dir / "mitmproxy" / node.name),
                str(work_dir / "logs"),
                engine_keys.key_for(backend),  # the node's gateway needs it; nothing else there has it
            )
            refs[ref] = node
        self._settle(refs, timeout=180)
        return self.live()

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

    def rollout(
        self,
        tasks: list[Task],
        config: RolloutConfig,
        *,
        out_dir: Path,
        work_dir: Path,
        engine_url: str,
        gateway_options: dict[str, str] | None = None,
        max_attempts: int = 2,
    ) -> RayRolloutResult:
        """G sessions per task across the live nodes; records under `out_dir/node-NAME/`."""
        return RayRollout(
            self,
            tasks,
            config,
            out_dir=out_dir,
            work_dir=work_dir,
            engine_url=engine_url,
            gateway_options=gateway_options or {},
            max_attempts=max_attempts,
        ).run()


class RayRollout:
    """One rollout on the pool: feeds the nodes, gathers outcomes, survives dead nodes, stops on a signal."""

    def __init__(
        self,
        pool: RayPool,
        tasks: list[Task],
        config: RolloutConfig,
        *,
        out_dir: Path,
        work_dir: Path,
        engine_url: str,
        gateway_options: dict[str, str],
        max_attempts: int,
    ) -> None:
        self.pool, self.config, self.max_attempts = pool, config, max_attempts
        self.out_dir, self.work_dir = Path(out_dir).resolve(), Path(work_dir).resolve()
        self.engine_url, self.gateway_options = engine_url, gateway_options
        self.pending = deque(
            SessionSpec(t, i, new_session_id(t, i)) for t in tasks for i in range(config.group_size)
        )
        self.tasks = {
            t.task_id: t for t in tasks
        }  # a finished session's task, whole (its judge, for judging)
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
        started = (
            time.monotonic()
        )  # the summary's wall time is the sessions' own; gateway start/stop is setup
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
        self.pool.begin(self.engine_url, self.gateway_options, self.config, self.work_dir, self.node_dir)
        self.dead += self.pool.dead_unreported  # died before this rollout gave them a session
        self.pool.dead_unreported.clear()

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
        except (
            ray.exceptions.RayTaskError
        ) as exc:  # our code failed on the node: that session fails, not the run
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
            raise RuntimeError(
                f"sample {key} finished twice ({self.outcomes[key].session_id}, {outcome.session_id})"
            )
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
        self.lost.append(
            {
                "session_id": spec.session_id,
                "task_id": spec.task.task_id,
                "index": spec.index,
                "node": node.name,
                "attempt": spec.attempt,
                "then": "rerun" if again else "node_lost",
            }
        )
        if again:
            self.pending.appendleft(
                SessionSpec(spec.task, spec.index, new_session_id(spec.task, spec.index), spec.attempt + 1)
            )
        else:
            self._record(
                self._failed(
                    spec, node.name, "node_lost", f"node {node.name} died during attempt {spec.attempt}"
                )
            )

    def _fail_unrunnable(self) -> None:
        """Sessions still pending when no node is left: reported `node_lost` with the failure reward."""
        while self.pending:
            spec = self.pending.popleft()
            self._record(self._failed(spec, "-", "node_lost", "no live rollout node left"))

    def _failed(
        self, spec: SessionSpec, node: str, status: str, why: str, *, reward: float | None | str = "failure"
    ) -> SessionOutcome:
        value = self.config.failure_reward if reward == "failure" else reward
        return SessionOutcome(
            session_id=spec.session_id,
            task_id=spec.task.task_id,
            index=spec.index,
            status=status,
            reward=value,
            exit_code=None,
            eval_output=why,
            node=node,  # type: ignore
            attempt=spec.attempt,
        )

    # -- the result ---------------------------------------------------------------------------------------------------

    def _result(self, seconds: float, interrupted: int | None) -> RayRolloutResult:
        outcomes = sorted(self.outcomes.values(), key=lambda o: (o.task_id, o.index))
        sessions = [self._session_run(o) for o in outcomes]
        return RayRolloutResult(
            RolloutSummary(sessions, seconds, self._utilisation(outcomes)),
            outcomes,
            {n.name: self.node_dir(n) for n in self.pool.nodes},
            list(self.dead),
            self.lost,
            interrupted,
        )

    def _session_run(self, o: SessionOutcome) -> SessionRun:
        task = self._task(o.task_id)
        s = SessionRun(
            task=task,
            index=o.index,
            session_id=o.session_id,
            stage="done",
            status=o.status,
            reward=o.reward,
            exit_code=o.exit_code,
            eval_output=o.eval_output,
        )
        s.spans = {stage: (0.0, value) for stage, value in o.seconds.items()}
        return s

    def _task(self, task_id: str) -> Task:
        return self.tasks.get(task_id) or Task(task_id=task_id, prompt="")

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
