"""The rollout service's jobs: each submitted task is a GRPO group whose sessions run in one staged runner shared by
every task (`StreamingRollout`: INIT → RUN → POST-RUN, the code `polar-mitm rollout` runs), against the service's
gateways; each session, as it finishes, becomes a `SessionResult` — written to disk first, then visible in the
task's status, on `/events` and at its callback.

Scheduling is per session: at most `max_sessions` are in the runner at once; a free slot goes to the next session of
the task with the highest `dispatch_priority`, then the earliest submitted (a task's sessions go out together, so a
GRPO group finishes close in time). At most `queue_limit` tasks wait with none of their sessions started (a full
queue is `QueueFull`, a 429). `early_stop_min_usable_sessions`: once that many sessions finished, the rest of the
group is cut (stopped, not reported). `metadata.min_weight_version`: none of the task's sessions starts before the
engine serves that weight version or a later one (read every `WEIGHTS_POLL_S` while a task waits, and at once after
a push through `POST /rollout/weights`); the task is `running` meanwhile, and once its `timeout_seconds` (counted
from the submit) pass, each session that never started is reported as a TIMEOUT saying why.

Durability (storage/service_layout.py): the request is on disk before the submit is answered and every result before
it is reported. After a kill, `resume()` reports each finished session again exactly once (from `results.jsonl`),
runs the sessions a task still lacks under the sample indices no result holds, and sends again every result its
callback never acknowledged (callbacks.py); a cancelled or finished task stays as it was.

Judged tasks (evaluator strategy `rubric`, judging.py) are judged before their results are written: each session
as it finishes, or with mode `group` the task's finished sessions together once none is left to finish (they hold
no RUN slot meanwhile, and `early_stop_min_usable_sessions` counts them).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.judges.options import JudgeOptions
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec, HarnessSpecError
from polar_mitm.rollout.runner import RolloutConfig, SessionRun
from polar_mitm.service import RESULTS_IN_MEMORY_TOKENS
from polar_mitm.service.callbacks import Callbacks, delivered
from polar_mitm.service.judging import ServiceJudge, Verdict
from polar_mitm.service.models import (
    LAGGED_EVENT,
    SessionResult,
    SessionStatus,
    SessionTiming,
    TaskRequest,
    TaskStatus,
    Trace,
    Trajectory,
    whole_version,
)
from polar_mitm.service.sessions import LocalSessions, RaySessions
from polar_mitm.service.task_requests import RequestError, check_runtime, request_task
from polar_mitm.storage import service_layout as layout
from polar_mitm.tasks.task_file import Task

logger = logging.getLogger(__name__)

STAGE_STATUS = {
    "pending": SessionStatus.REGISTERED,
    "init": SessionStatus.INITIALIZING,
    "ready": SessionStatus.READY,
    "run": SessionStatus.RUNNING,
    "post": SessionStatus.POST_RUN,
}
OUTCOME_STATUS = {
    "ok": SessionStatus.COMPLETED,
    "failed": SessionStatus.COMPLETED,
    "timeout": SessionStatus.TIMEOUT,
}
FINISHED = ("completed", "failed", "cancelled")
# Finished tasks kept in memory at all (whatever their tokens); older ones are let go of whole and a GET reads them
# from their folder: a service that ran 100k tasks must not hold 100k requests, nor walk them on each /health.
FINISHED_TASKS_KEPT = 1024
EVENTS_BUFFERED = 1000  # events kept for each /events subscriber that has not read them yet
STREAM_CHECK_S = 0.5  # how soon an idle /events stream notices the service stopping
WEIGHTS_POLL_S = 0.5  # how often the engine's weight version is read while a task waits for a newer one


class Conflict(Exception):
    """A task with this id is still running (409)."""


class QueueFull(Exception):
    """`queue_limit` tasks already wait (429)."""


@dataclass
class Job:
    request: TaskRequest
    task: Task
    harness: HarnessSpec
    folder: Path
    results: dict[str, SessionResult] = field(default_factory=dict)
    state: str = "queued"  # queued | running | completed | failed | cancelled
    order: int = 0
    unsent: int = 0  # sessions not yet handed to the runner
    inflight: set[str] = field(default_factory=set)  # in the runner, or their result being written
    taken: set[int] = field(
        default_factory=set
    )  # sample indices given to a session (a result's, after --resume)
    submitted_at: float = field(default_factory=time.time)  # what timeout_seconds counts from, while it waits
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)
    held: list[SessionRun] = field(
        default_factory=list
    )  # finished, waiting for their group's judge (mode group)
    results_on_disk: bool = (
        False  # a finished task whose results left memory: a GET reads them back (`leave_memory`)
    )

    def claim_index(self) -> int:
        """The lowest sample index no session of this task holds."""
        index = next(i for i in itertools.count() if i not in self.taken)
        self.taken.add(index)
        return index

    def status(self) -> TaskStatus:
        """What GET answers (reads the results file once they left memory: call it off the event loop then)."""
        results = saved_results(self.folder) if self.results_on_disk else list(self.results.values())
        return task_status(self.request, self.state, results)

    def trace_tokens(self) -> int:
        return sum(
            len(t.prompt_ids) + len(t.response_ids)
            for r in self.results.values()
            for t in r.trajectory.traces
        )

    def leave_memory(self) -> None:
        """A finished task's results are on disk already: memory lets them go."""
        self.results, self.results_on_disk = {}, True


def task_status(request: TaskRequest, state: str, results: list[SessionResult]) -> TaskStatus:
    wire = {"queued": "running", "running": "running", "completed": "completed"}.get(state, "failed")
    return TaskStatus(
        task_id=request.task_id,
        status=wire,
        total_sessions=request.num_samples,
        completed_sessions=len(results),
        results=results,
    )


def saved_results(folder: Path) -> list[SessionResult]:
    """A task's results file, each session once (its first line, as `--resume` reads it)."""
    found: dict[str, SessionResult] = {}
    for row in layout.read_lines(folder / layout.RESULTS_FILE):
        result = SessionResult.model_validate(row)
        found.setdefault(result.session_id, result)
    return list(found.values())


def saved_status(folder: Path, state: str) -> TaskStatus:
    """The status of a finished task from its folder alone (one the service let go of)."""
    request = TaskRequest.model_validate_json((folder / layout.REQUEST_FILE).read_text())
    return task_status(request, state, saved_results(folder))


class EventBus:
    """Every session state change to each `/events` subscriber (a bounded queue each: a slow reader loses its
    oldest events, never holds up a session, and is told so by a `lagged` event)."""

    def __init__(self, buffered: int = EVENTS_BUFFERED) -> None:
        self.buffered = buffered
        self.subscribers: dict[
            asyncio.Queue, frozenset[str]
        ] = {}  # each one's queue → the event types it wants
        self.lagging: set[asyncio.Queue] = set()  # subscribers that lost events since they last read one
        self.ids = itertools.count(1)

    def publish(self, event: dict[str, Any]) -> None:
        event = {"id": next(self.ids), "time": time.time(), **event}
        for queue, kinds in list(self.subscribers.items()):
            if kinds and event["type"] not in kinds:
                continue
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
                self.lagging.add(queue)
            queue.put_nowait(event)

    async def stream(
        self, stopping: Callable[[], bool] = lambda: False, kinds: frozenset[str] = frozenset()
    ) -> AsyncIterator[dict[str, Any]]:
        """Every event (of `kinds`, if given) from now on, until `stopping()` (checked each `STREAM_CHECK_S` while
        none comes)."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.buffered)
        self.subscribers[queue] = kinds
        try:
            while not stopping():
                try:
                    event = await asyncio.wait_for(queue.get(), STREAM_CHECK_S)
                except TimeoutError:
                    continue
                if queue in self.lagging:  # a waiting client could never hear of what was lost: say so
                    self.lagging.discard(queue)
                    yield {"id": next(self.ids), "time": time.time(), "type": LAGGED_EVENT}
                yield event
        finally:
            self.subscribers.pop(queue, None)
            self.lagging.discard(queue)


def runner_config(
    work: Path, max_sessions: int, sandbox: tuple[str, str | None] = ("bwrap", None)
) -> RolloutConfig:
    """The service's staged runner (on each Ray node too): no READY buffer, a session is prepared once it has a
    slot; workspaces and harness logs under the service's work folder; each session in `sandbox` (kind, image)."""
    return RolloutConfig(
        sandbox=sandbox[0],
        image=sandbox[1],
        concurrency=max_sessions,
        init_workers=min(2, max_sessions),
        post_workers=min(2, max_sessions),
        ready_buffer=0,
        workspace_root=work / "workspaces",
        log_dir=work / "logs",
    )


class RolloutService:
    """Owns the jobs; the HTTP layer (server.py) and the CLI only call its methods, on its event loop."""

    def __init__(
        self,
        out: Path,
        endpoints: list[GatewayEndpoints],
        *,
        task_root: Path,
        max_sessions: int = 8,
        queue_limit: int = 64,
        engine_url: str | None = None,
        sampling: dict[str, str] | None = None,
        gateway_options: dict[str, str] | None = None,
        sessions: LocalSessions | RaySessions | None = None,
        sandbox: tuple[str, str | None] = ("bwrap", None),
        judging: JudgeOptions | None = None,
        results_in_memory: int = RESULTS_IN_MEMORY_TOKENS,
    ) -> None:
        self.out, self.endpoints, self.task_root, self.sandbox = out, endpoints, task_root, sandbox
        self.results_in_memory = results_in_memory
        # Finished jobs whose results are still in memory, the oldest first: id(job) → (job, its trace tokens).
        self._kept: OrderedDict[int, tuple[Job, int]] = OrderedDict()
        self._kept_tokens = 0
        self._let_go: dict[str, str] = {}  # task id → final state, of finished tasks no longer in `jobs`
        self._let_go_states: Counter[str] = Counter()
        self.sampling = dict(sampling or {})  # what the gateways force on every call (polar_temperature, …)
        self.gateway_options = dict(gateway_options or self.sampling)  # all the gateways are given
        self.flows = out / layout.FLOWS_DIR
        self.work = out / layout.WORK_DIR
        self.max_sessions, self.queue_limit, self.engine_url = max_sessions, queue_limit, engine_url
        self.jobs: dict[str, Job] = {}
        # The jobs that may still send or finish sessions (queued or running): what dispatching, the submit's queue
        # count and the weights watch look at, so that a long-lived service's finished tasks cost them nothing.
        self._open: dict[str, Job] = {}
        self.events = EventBus()
        self.order = itertools.count()
        self._wake: asyncio.Event | None = None
        self._dispatcher: asyncio.Task | None = None
        self._weights_watch: asyncio.Task | None = None
        self.weight_version: str | None = (
            None  # the engine's, as last read (while a task waits for a newer one)
        )
        self._weights_problem: str | None = None
        self.callbacks = Callbacks()
        self._unacknowledged: list[tuple[Job, SessionResult]] = []  # found by resume(), sent again by start()
        self._sessions: set[asyncio.Task] = set()
        self._stages: dict[str, str] = {}  # session id → the last stage published
        self._owner: dict[str, Job] = {}  # session id → its job, while it runs
        self._accepting: set[str] = set()  # task ids whose files are being written (submit)
        # Where sessions run: here against `endpoints` unless given (RaySessions: on a cluster's nodes).
        self.pool = sessions or LocalSessions(
            endpoints, runner_config(self.work, max_sessions, sandbox), self.flows
        )
        self.pool.watch(self._on_stage)
        harness_logs = runner_config(self.work, max_sessions, sandbox).log_dir
        self.judge = ServiceJudge(judging or JudgeOptions(), out, self.flows, harness_logs)

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.pool.start()
        self._wake = asyncio.Event()
        self._dispatcher = asyncio.create_task(self._dispatch())
        for job in self.jobs.values():  # after --resume: a group whose every session was held is judged now
            if job.held:
                judging = asyncio.create_task(self._group_finished(job))
                self._sessions.add(judging)
                judging.add_done_callback(self._sessions.discard)
        self._weights_watch = asyncio.create_task(self._watch_weights())
        for job, result in self._unacknowledged:
            assert job.request.callback_url is not None
            self.callbacks.send(job.request.callback_url, result, job.folder)
        self._unacknowledged = []
        self._wake.set()

    async def close(self) -> None:
        """Stop dispatching and the runner's harnesses (finished sessions are on disk; `--resume` runs the rest)."""
        for background in (self._dispatcher, self._weights_watch):
            if background is not None:
                background.cancel()
        for job in self.jobs.values():
            if job.state == "running":
                job.state = "queued"
        await self.pool.close()  # the harnesses stop; their sessions never resolve, so they are cancelled too
        for running in self._sessions:
            running.cancel()
        await asyncio.gather(*self._sessions, return_exceptions=True)
        await self.callbacks.close()

    def resume(self) -> int:
        """Load the tasks under OUT/tasks: finished ones as they were, unfinished ones queued for the sessions they
        lack; the number of sessions that will run again."""
        rerun = 0
        for folder in sorted((self.out / layout.TASKS_DIR).glob("*")):
            saved = json.loads((folder / layout.STATE_FILE).read_text())
            if saved.get("status") in FINISHED and "task_id" in saved and not saved.get("callbacks"):
                self._forget_finished(saved["task_id"], saved["status"])  # nothing to do but answer GETs
                continue
            request = TaskRequest.model_validate_json((folder / layout.REQUEST_FILE).read_text())
            task, harness = request_task(request, self.task_root), HarnessSpec(request.agent.harness)
            job = Job(request, task, harness, folder, order=next(self.order))
            for row in layout.read_lines(folder / layout.RESULTS_FILE):
                result = SessionResult.model_validate(row)
                job.results.setdefault(result.session_id, result)
            job.taken = {
                int(r.metadata["sample_index"]) for r in job.results.values() if "sample_index" in r.metadata
            }
            # Finished sessions that waited for their group's judge: held again, judged with their group.
            for row in layout.read_lines(folder / layout.HELD_FILE):
                if row["session_id"] not in job.results and row["index"] not in job.taken:
                    job.held.append(held_session(row, task))
                    job.inflight.add(row["session_id"])
                    job.taken.add(row["index"])
            job.unsent = max(request.num_samples - len(job.results) - len(job.held), 0)
            job.submitted_at = saved.get("submitted_at", job.submitted_at)
            state = saved.get("status", "running")
            job.state = state if state in ("completed", "failed", "cancelled") else "queued"
            if job.state == "queued":
                rerun += job.unsent
            else:
                job.held, job.inflight = [], set()  # a finished task's held sessions were reported
            if request.callback_url:
                acknowledged = delivered(folder)
                self._unacknowledged += [
                    (job, r) for r in job.results.values() if r.session_id not in acknowledged
                ]
            self.jobs[request.task_id] = job
            if job.state == "queued":
                self._open[request.task_id] = job
            else:
                self._keep(job)
        if self._wake is not None:
            self._wake.set()
        return rerun

    # -- requests -----------------------------------------------------------------------------------------------

    async def submit(self, request: TaskRequest) -> None:
        """Accept a task (on disk before this returns); RequestError, Conflict or QueueFull refuse it. Its files
        are written off the event loop (fsyncs under load would hold up every running session)."""
        harness = HarnessSpec(
            request.agent.harness
        )  # HarnessSpecError: an unknown harness, before anything is kept
        task = request_task(request, self.task_root)
        check_runtime(request.runtime, self.sandbox)
        self.judge.check(task)
        if request.min_weight_version is not None and self.engine_url is None:
            raise RequestError(
                "metadata.min_weight_version: this service has no engine whose version it can read"
            )
        known = self.jobs.get(request.task_id)
        if request.task_id in self._accepting or (known is not None and known.state in ("queued", "running")):
            raise Conflict(f"task {request.task_id!r} is still running")
        waiting = sum(job.state == "queued" for job in self._open_jobs()) + len(self._accepting)
        if waiting >= self.queue_limit:
            raise QueueFull(f"{self.queue_limit} tasks already wait")
        folder = layout.task_dir(self.out, request.task_id)
        job = Job(request, task, harness, folder, order=next(self.order), unsent=request.num_samples)
        self._accepting.add(request.task_id)  # while its files are written: a second submit of it conflicts
        try:
            await asyncio.to_thread(layout.write_task, folder, request.model_dump_json(), job.submitted_at)
        finally:
            self._accepting.discard(request.task_id)
        self.jobs[request.task_id] = self._open[request.task_id] = job
        if (earlier := self._let_go.pop(request.task_id, None)) is not None:  # a new run of a finished task
            self._let_go_states[earlier] -= 1
        self.events.publish({"type": "task", "task_id": request.task_id, "status": "queued"})
        assert self._wake is not None
        self._wake.set()

    async def status(self, task_id: str) -> TaskStatus | None:
        job = self.jobs.get(task_id)
        if job is None and task_id in self._let_go:
            folder = layout.task_dir(self.out, task_id)
            return await asyncio.to_thread(saved_status, folder, self._let_go[task_id])
        return None if job is None else await self._status_of(job)

    @staticmethod
    async def _status_of(job: Job) -> TaskStatus:
        return await asyncio.to_thread(job.status) if job.results_on_disk else job.status()

    async def cancel(self, task_id: str) -> TaskStatus | None:
        """Stop a task's harnesses; the sessions that finished keep their results, each reported once."""
        job = self.jobs.get(task_id)
        if job is None:
            return await self.status(task_id)  # unknown (None), or finished long ago: nothing to cancel
        if job.state in ("queued", "running"):
            job.state, job.unsent = "cancelled", 0
            await self.pool.cut_group(task_id)
            while job.inflight:  # cut sessions end at once; results being written are kept
                await asyncio.sleep(0.05)
            await self._write_state(job, "cancelled")
        return await self._status_of(job)

    def health(self) -> dict[str, Any]:
        states = Counter(job.state for job in self.jobs.values()) + self._let_go_states
        return {
            "status": "ok",
            "tasks": dict(sorted(states.items())),
            "running_sessions": self._in_flight(),
            "max_sessions": self.max_sessions,
            "gateways": self.pool.places,
            "results_in_memory": {"finished_tasks": len(self._kept), "trace_tokens": self._kept_tokens},
            "sampling": self.sampling,
            "gateway_options": self.gateway_options,
        }

    def weights_pushed(self, version: str | None) -> None:
        """A push through `POST /rollout/weights` landed: tasks waiting for `version` may start now."""
        self.weight_version = version
        if self._wake is not None:
            self._wake.set()

    # -- running ------------------------------------------------------------------------------------------------

    def _open_jobs(self) -> list[Job]:
        """The queued and running jobs (those whose state moved on are let go here)."""
        for task_id in [
            task_id for task_id, job in self._open.items() if job.state not in ("queued", "running")
        ]:
            del self._open[task_id]
        return list(self._open.values())

    def _in_flight(self) -> int:
        """Sessions holding a RUN slot: a session being evaluated, or its result written, leaves it (as the
        runner's RUN worker moves on at POST-RUN)."""
        return sum(stage not in ("post", "done") for stage in self._stages.values())

    def _weights_ready(self, job: Job) -> bool:
        """Whether the engine serves the weights `job` waits for (`metadata.min_weight_version`), as last read."""
        wanted = job.request.min_weight_version
        if wanted is None:
            return True
        served = None if self.weight_version is None else whole_version(self.weight_version)
        return served is not None and served >= wanted

    async def _watch_weights(self) -> None:
        """While a task waits for newer weights: read the engine's version, and end the waits whose time is up."""
        assert self._wake is not None
        while True:
            waiting = [job for job in self._open_jobs() if job.unsent and not self._weights_ready(job)]
            if waiting:
                await self._read_weight_version()
                for job in waiting:
                    late = time.time() >= job.submitted_at + job.request.timeout_seconds
                    if late and job.unsent and not self._weights_ready(job):
                        try:
                            await self._expire(job)
                        except Exception:  # a bug of ours: said, and the other waits go on
                            logger.exception("ending the wait of task %s", job.request.task_id)
                self._wake.set()
            await asyncio.sleep(WEIGHTS_POLL_S)

    async def _read_weight_version(self) -> None:
        from polar_mitm.engines.weights import common_weight_version

        try:
            self.weight_version = await asyncio.to_thread(common_weight_version, self.engine_url)
            self._weights_problem = None
        except Exception as exc:  # noqa: BLE001 — an engine not answering is waited out (and said once)
            problem = f"{type(exc).__name__}: {exc}"
            if problem != self._weights_problem:
                logger.warning("reading the engine's weight version: %s", problem)
            self._weights_problem = problem

    async def _expire(self, job: Job) -> None:
        """`job` waited its `timeout_seconds` for weights that never came: each session it still lacks is a
        TIMEOUT result (reported once, as any other)."""
        why = (
            f"timeout_seconds {job.request.timeout_seconds:g} passed waiting for weight_version ≥ "
            f"{job.request.min_weight_version}; the engine serves {self.weight_version}"
        )
        unsent, job.state, job.unsent = job.unsent, "running", 0
        for _ in range(unsent):
            index = job.claim_index()
            await self._report(
                job,
                SessionResult(
                    session_id=f"{job.task.task_id}-{index}-{uuid.uuid4().hex[:8]}",
                    task_id=job.request.task_id,
                    status=SessionStatus.TIMEOUT,
                    trajectory=Trajectory(
                        status="TIMEOUT",
                        error=why,
                        metadata={"reward": None, "outcome": "timeout", "exit_code": None},
                    ),
                    error=why,
                    metadata={"sample_index": index, "harness": job.request.agent.harness},
                ),
            )

    async def _dispatch(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            ready = sorted(
                (job for job in self._open_jobs() if job.unsent and self._weights_ready(job)),
                key=lambda job: (-job.request.dispatch_priority, job.order),
            )
            in_flight = self._in_flight()
            for job in ready:
                while job.unsent and in_flight < self.max_sessions:
                    self._send(job)
                    in_flight += 1
                if job.unsent:
                    break  # in priority order: a later task does not overtake this one
            for job in self._open_jobs():
                self._maybe_done(job)

    def _send(self, job: Job) -> None:
        job.state, job.unsent = "running", job.unsent - 1
        index = job.claim_index()
        s = SessionRun(
            task=job.task, index=index, session_id=f"{job.task.task_id}-{index}-{uuid.uuid4().hex[:8]}"
        )
        job.inflight.add(s.session_id)
        self._owner[s.session_id] = job
        self._stages[s.session_id] = s.stage
        self._publish_session(job, s.session_id, SessionStatus.REGISTERED)
        running = asyncio.create_task(self._session(job, s))
        self._sessions.add(running)
        running.add_done_callback(self._sessions.discard)

    async def _session(self, job: Job, s: SessionRun) -> None:
        try:
            await self.pool.run(s, job.harness)
            if s.status and s.status != "cut" and self.judge.holds_group(job.task):
                # On disk first (a kill before its group is judged must not run it again), then held: still in
                # `inflight`, so the task is not done before its group is reported.
                await asyncio.to_thread(layout.append_line, job.folder / layout.HELD_FILE, held_row(s))
                job.held.append(s)
            elif s.status and s.status != "cut":
                await self._finished(job, [s])
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug of ours: the session is lost, said; the service goes on
            logger.exception("session %s of task %s", s.session_id, job.request.task_id)
        finally:
            if s not in job.held:
                job.inflight.discard(s.session_id)
            self._owner.pop(s.session_id, None)
            self._stages.pop(s.session_id, None)
            self.pool.forget(s)
            self._early_stop(job)
            assert self._wake is not None
            self._wake.set()
        await self._group_finished(job)

    async def _group_finished(self, job: Job) -> None:
        """Mode group: once no session of `job` is left to finish, its held sessions judged together, reported."""
        held_ids = {h.session_id for h in job.held}
        if not job.held or job.unsent or not job.inflight <= held_ids:
            return
        held, job.held = job.held, []
        try:
            await self._finished(job, held)
        except Exception:  # a bug of ours: the group is lost, said; the service goes on
            logger.exception("the group of task %s", job.request.task_id)
        finally:
            job.inflight -= held_ids
            assert self._wake is not None
            self._wake.set()

    def _early_stop(self, job: Job) -> None:
        wanted = job.request.early_stop_min_usable_sessions
        if (
            wanted is not None
            and job.state == "running"
            and len(job.results) + len(job.held) >= wanted
            and job.unsent + len(job.inflight)
        ):
            job.unsent = 0
            asyncio.get_running_loop().create_task(self.pool.cut_group(job.task.task_id))

    def _maybe_done(self, job: Job) -> None:
        # "queued" too: after --resume, a task all of whose results were written before the kill (its state not yet)
        if job.state in ("queued", "running") and not job.unsent and not job.inflight:
            self._set_state(job, "completed")

    def _on_stage(self, s: SessionRun) -> None:
        job = self._owner.get(s.session_id)
        if job is None or self._stages.get(s.session_id) == s.stage:
            return
        self._stages[s.session_id] = s.stage
        if s.stage in STAGE_STATUS:
            self._publish_session(job, s.session_id, STAGE_STATUS[s.stage])
        if s.stage in ("post", "done") and self._wake is not None:
            self._wake.set()  # its RUN slot is free

    async def _finished(self, job: Job, sessions: list[SessionRun]) -> None:
        """Finished sessions of `job` judged (their rewards become the judged ones), merged and reported."""
        verdicts = await self.judge.judge(job.folder, sessions)
        for s in sessions:
            try:
                traces, problem = await self.pool.traces(s, job.request.builder.strategy), None
            except Exception as exc:  # noqa: BLE001 — a session whose records cannot be merged is an ERROR, named
                traces, problem = [], f"its records could not be merged: {exc}"
            await self._report(job, self._result(job, s, traces, problem, verdicts.get(s.session_id)))

    async def _report(self, job: Job, result: SessionResult) -> None:
        """A finished session: on disk first, then in the task's status, on /events and at its callback."""
        async with job.writing:  # the file and the status list the results in one order
            row = result.model_dump(mode="json")
            await asyncio.to_thread(layout.append_line, job.folder / layout.RESULTS_FILE, row)
            job.results[result.session_id] = result  # reported only once it is on disk
        self._publish_session(job, result.session_id, result.status, reward=_reward(result))
        if job.request.callback_url:
            self.callbacks.send(job.request.callback_url, result, job.folder)

    def _result(
        self,
        job: Job,
        s: SessionRun,
        traces: list[Trace],
        problem: str | None,
        verdict: Verdict | None = None,
    ) -> SessionResult:
        status = OUTCOME_STATUS.get(s.status, SessionStatus.ERROR)
        error = None if status is SessionStatus.COMPLETED else f"{s.status}: {s.eval_output[-500:]}".strip()
        for why in (verdict.error if verdict else None, problem):
            if why is not None:
                status, error = SessionStatus.ERROR, why
        judged = {"judge": verdict.judge} if verdict is not None else {}
        return SessionResult(
            session_id=s.session_id,
            task_id=job.request.task_id,
            status=status,
            trajectory=Trajectory(
                status=status.value,
                traces=traces,
                error=error,
                metadata={"reward": s.reward, "outcome": s.status, "exit_code": s.exit_code, **judged},
            ),
            timing=_timing(s),
            error=error,
            metadata={"sample_index": s.index, "harness": job.request.agent.harness},
        )

    def _publish_session(self, job: Job, session_id: str, status: SessionStatus, **extra: Any) -> None:
        self.events.publish(
            {
                "type": "session",
                "task_id": job.request.task_id,
                "session_id": session_id,
                "status": status,
                **extra,
            }
        )

    def _set_state(self, job: Job, state: str) -> None:
        """`job` is `state` now; on disk (off the event loop) before /events says so."""
        job.state = state
        background = asyncio.get_running_loop().create_task(self._write_state(job, state))
        self._sessions.add(background)  # kept until done; close() waits for it
        background.add_done_callback(self._sessions.discard)

    async def _write_state(self, job: Job, state: str) -> None:
        async with job.writing:
            await asyncio.to_thread(
                layout.write_durable,
                job.folder / layout.STATE_FILE,
                json.dumps(
                    {
                        "status": state,
                        "submitted_at": job.submitted_at,
                        "task_id": job.request.task_id,
                        # results its callback may not have acknowledged: --resume must load them
                        "callbacks": bool(job.request.callback_url),
                    }
                ),
            )
        if state in FINISHED:
            self._keep(job)
        self.events.publish({"type": "task", "task_id": job.request.task_id, "status": state})

    def _keep(self, job: Job) -> None:
        """A finished job's results stay in memory for GETs; beyond `results_in_memory` trace tokens the oldest
        finished jobs let theirs go (on disk since each was reported)."""
        if job.results_on_disk or id(job) in self._kept:
            return
        tokens = job.trace_tokens()
        self._kept[id(job)] = (job, tokens)
        self._kept_tokens += tokens
        while self._kept and (
            self._kept_tokens > self.results_in_memory or len(self._kept) > FINISHED_TASKS_KEPT
        ):
            _, (oldest, held) = self._kept.popitem(last=False)
            self._kept_tokens -= held
            oldest.leave_memory()
            if self.jobs.get(oldest.request.task_id) is oldest:  # (not replaced by a new run of the same id)
                del self.jobs[oldest.request.task_id]
                self._forget_finished(oldest.request.task_id, oldest.state)

    def task_count(self) -> int:
        """Every task the service knows: in memory, and finished ones it let go of (answered from their folder)."""
        return len(self.jobs) + len(self._let_go)

    def _forget_finished(self, task_id: str, state: str) -> None:
        """A finished task lives on in its folder alone: a GET reads it from there (`saved_status`)."""
        self._let_go[task_id] = state
        self._let_go_states[state] += 1


def held_row(s: SessionRun) -> dict[str, Any]:
    """What `--resume` needs of a held session to judge and report it with its group."""
    return {
        "session_id": s.session_id,
        "index": s.index,
        "status": s.status,
        "end": s.end,
        "reward": s.reward,
        "exit_code": s.exit_code,
        "eval_output": s.eval_output,
        "spans": {stage: list(span) for stage, span in s.spans.items()},
    }


def held_session(row: dict[str, Any], task: Task) -> SessionRun:
    return SessionRun(
        task=task,
        index=int(row["index"]),
        session_id=row["session_id"],
        stage="done",
        status=row["status"],
        end=row.get("end"),
        reward=row.get("reward"),
        exit_code=row.get("exit_code"),
        eval_output=row.get("eval_output") or "",
        spans={stage: (float(a), float(b)) for stage, (a, b) in (row.get("spans") or {}).items()},
    )


def _reward(result: SessionResult) -> float | None:
    return result.trajectory.metadata.get("reward")


def _timing(s: SessionRun) -> SessionTiming:
    def ms(stage: str) -> float:
        seconds = s.seconds(stage)
        return round(seconds * 1000, 1) if seconds is not None else 0.0

    spans = list(s.spans.values())
    e2e = (max(e for _, e in spans) - min(b for b, _ in spans)) * 1000 if spans else 0.0
    return SessionTiming(init_ms=ms("init"), run_ms=ms("run"), postrun_ms=ms("post"), e2e_ms=round(e2e, 1))


__all__ = ["Conflict", "HarnessSpecError", "QueueFull", "RequestError", "RolloutService"]
