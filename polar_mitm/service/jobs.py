"""The rollout service's jobs: each submitted task is a GRPO group whose sessions run in one staged runner shared by
every task (`StreamingRollout`: INIT → RUN → POST-RUN, the code `polar-mitm rollout` runs), against the service's
gateways; each session, as it finishes, becomes a `SessionResult` — written to disk first, then visible in the
task's status, on `/events` and at its callback.

Scheduling is per session: at most `max_sessions` are in the runner at once; a free slot goes to the next session of
the task with the highest `dispatch_priority`, then the earliest submitted (a task's sessions go out together, so a
GRPO group finishes close in time). At most `queue_limit` tasks wait with none of their sessions started (a full
queue is `QueueFull`, a 429). `early_stop_min_usable_sessions`: once that many sessions finished, the rest of the
group is cut (stopped, not reported).

Durability (storage/service_layout.py): the request is on disk before the submit is answered and every result before
it is reported. After a kill, `resume()` reports each finished session again exactly once (from `results.jsonl`) and
runs the sessions a task still lacks; a cancelled or finished task stays as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec, HarnessSpecError
from polar_mitm.rollout.runner import RolloutConfig, SessionRun
from polar_mitm.service.models import (
    SessionResult,
    SessionStatus,
    SessionTiming,
    TaskRequest,
    TaskStatus,
    Trace,
    Trajectory,
)
from polar_mitm.service.sessions import LocalSessions, RaySessions
from polar_mitm.service.task_requests import RequestError, request_task
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
CALLBACK_TRIES = 5
STREAM_CHECK_S = 0.5  # how soon an idle /events stream notices the service stopping


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
    next_index: int = 0
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)

    def status(self) -> TaskStatus:
        wire = {"queued": "running", "running": "running", "completed": "completed"}.get(self.state, "failed")
        return TaskStatus(
            task_id=self.request.task_id,
            status=wire,
            total_sessions=self.request.num_samples,
            completed_sessions=len(self.results),
            results=list(self.results.values()),
        )


class EventBus:
    """Every session state change to each `/events` subscriber (a bounded queue each: a slow reader loses its
    oldest events, never holds up a session)."""

    def __init__(self) -> None:
        self.subscribers: set[asyncio.Queue] = set()
        self.ids = itertools.count(1)

    def publish(self, event: dict[str, Any]) -> None:
        event = {"id": next(self.ids), "time": time.time(), **event}
        for queue in list(self.subscribers):
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(event)

    async def stream(self, stopping: Callable[[], bool] = lambda: False) -> AsyncIterator[dict[str, Any]]:
        """Every event from now on, until `stopping()` (checked each `STREAM_CHECK_S` while none comes)."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=1000)
        self.subscribers.add(queue)
        try:
            while not stopping():
                try:
                    yield await asyncio.wait_for(queue.get(), STREAM_CHECK_S)
                except TimeoutError:
                    continue
        finally:
            self.subscribers.discard(queue)


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
        sessions: LocalSessions | RaySessions | None = None,
        sandbox: tuple[str, str | None] = ("bwrap", None),
    ) -> None:
        self.out, self.endpoints, self.task_root = out, endpoints, task_root
        self.sampling = dict(sampling or {})  # what the gateways force on every call (polar_temperature, …)
        self.flows = out / layout.FLOWS_DIR
        self.work = out / layout.WORK_DIR
        self.max_sessions, self.queue_limit, self.engine_url = max_sessions, queue_limit, engine_url
        self.jobs: dict[str, Job] = {}
        self.events = EventBus()
        self.order = itertools.count()
        self._wake: asyncio.Event | None = None
        self._dispatcher: asyncio.Task | None = None
        self._callbacks: set[asyncio.Task] = set()
        self._sessions: set[asyncio.Task] = set()
        self._stages: dict[str, str] = {}  # session id → the last stage published
        self._owner: dict[str, Job] = {}  # session id → its job, while it runs
        # Where sessions run: here against `endpoints` unless given (RaySessions: on a cluster's nodes).
        self.pool = sessions or LocalSessions(
            endpoints, runner_config(self.work, max_sessions, sandbox), self.flows
        )
        self.pool.watch(self._on_update)

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.pool.start()
        self._wake = asyncio.Event()
        self._dispatcher = asyncio.create_task(self._dispatch())
        self._wake.set()

    async def close(self) -> None:
        """Stop dispatching and the runner's harnesses (finished sessions are on disk; `--resume` runs the rest)."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        for job in self.jobs.values():
            if job.state == "running":
                job.state = "queued"
        await self.pool.close()  # the harnesses stop; their sessions never resolve, so they are cancelled too
        for running in self._sessions:
            running.cancel()
        await asyncio.gather(*self._sessions, *self._callbacks, return_exceptions=True)

    def resume(self) -> int:
        """Load the tasks under OUT/tasks: finished ones as they were, unfinished ones queued for the sessions they
        lack; the number of sessions that will run again."""
        rerun = 0
        for folder in sorted((self.out / layout.TASKS_DIR).glob("*")):
            request = TaskRequest.model_validate_json((folder / layout.REQUEST_FILE).read_text())
            task, harness = request_task(request, self.task_root), HarnessSpec(request.agent.harness)
            job = Job(request, task, harness, folder, order=next(self.order))
            for row in layout.read_lines(folder / layout.RESULTS_FILE):
                result = SessionResult.model_validate(row)
                job.results.setdefault(result.session_id, result)
            job.unsent = max(request.num_samples - len(job.results), 0)
            job.next_index = len(job.results)
            state = json.loads((folder / layout.STATE_FILE).read_text()).get("status", "running")
            job.state = state if state in ("completed", "failed", "cancelled") else "queued"
            if job.state == "queued":
                rerun += job.unsent
            self.jobs[request.task_id] = job
        if self._wake is not None:
            self._wake.set()
        return rerun

    # -- requests -----------------------------------------------------------------------------------------------

    def submit(self, request: TaskRequest) -> None:
        """Accept a task (on disk before this returns); RequestError, Conflict or QueueFull refuse it."""
        harness = HarnessSpec(
            request.agent.harness
        )  # HarnessSpecError: an unknown harness, before anything is kept
        task = request_task(request, self.task_root)
        known = self.jobs.get(request.task_id)
        if known is not None and known.state in ("queued", "running"):
            raise Conflict(f"task {request.task_id!r} is still running")
        if sum(job.state == "queued" for job in self.jobs.values()) >= self.queue_limit:
            raise QueueFull(f"{self.queue_limit} tasks already wait")
        folder = layout.task_dir(self.out, request.task_id)
        if folder.exists():  # a finished task of the same id, submitted again: a new run of it
            for name in (layout.RESULTS_FILE, layout.STATE_FILE):
                (folder / name).unlink(missing_ok=True)
        layout.write_durable(folder / layout.REQUEST_FILE, request.model_dump_json())
        layout.write_durable(folder / layout.STATE_FILE, json.dumps({"status": "running"}))
        job = Job(request, task, harness, folder, order=next(self.order), unsent=request.num_samples)
        self.jobs[request.task_id] = job
        self.events.publish({"type": "task", "task_id": request.task_id, "status": "queued"})
        assert self._wake is not None
        self._wake.set()

    def status(self, task_id: str) -> TaskStatus | None:
        job = self.jobs.get(task_id)
        return None if job is None else job.status()

    async def cancel(self, task_id: str) -> TaskStatus | None:
        """Stop a task's harnesses; the sessions that finished keep their results, each reported once."""
        job = self.jobs.get(task_id)
        if job is None:
            return None
        if job.state in ("queued", "running"):
            job.state, job.unsent = "cancelled", 0
            await self.pool.cut_group(task_id)
            while job.inflight:  # cut sessions end at once; results being written are kept
                await asyncio.sleep(0.05)
            self._set_state(job, "cancelled")
        return job.status()

    def health(self) -> dict[str, Any]:
        states = [job.state for job in self.jobs.values()]
        return {
            "status": "ok",
            "tasks": {state: states.count(state) for state in sorted(set(states))},
            "running_sessions": self._in_flight(),
            "max_sessions": self.max_sessions,
            "gateways": self.pool.places,
            "sampling": self.sampling,
        }

    # -- running ------------------------------------------------------------------------------------------------

    def _in_flight(self) -> int:
        """Sessions holding a RUN slot: a session being evaluated, or its result written, leaves it (as the
        runner's RUN worker moves on at POST-RUN)."""
        return sum(stage not in ("post", "done") for stage in self._stages.values())

    async def _dispatch(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            ready = sorted(
                (job for job in self.jobs.values() if job.state in ("queued", "running") and job.unsent),
                key=lambda job: (-job.request.dispatch_priority, job.order),
            )
            for job in ready:
                while job.unsent and self._in_flight() < self.max_sessions:
                    self._send(job)
                if job.unsent:
                    break  # in priority order: a later task does not overtake this one
            for job in self.jobs.values():
                self._maybe_done(job)

    def _send(self, job: Job) -> None:
        job.state, job.unsent = "running", job.unsent - 1
        index, job.next_index = job.next_index, job.next_index + 1
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
            if s.status and s.status != "cut":
                await self._finished(job, s)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug of ours: the session is lost, said; the service goes on
            logger.exception("session %s of task %s", s.session_id, job.request.task_id)
        finally:
            job.inflight.discard(s.session_id)
            self._owner.pop(s.session_id, None)
            self._stages.pop(s.session_id, None)
            self.pool.forget(s)
            self._early_stop(job)
            assert self._wake is not None
            self._wake.set()

    def _early_stop(self, job: Job) -> None:
        wanted = job.request.early_stop_min_usable_sessions
        if (
            wanted is not None
            and job.state == "running"
            and len(job.results) >= wanted
            and job.unsent + len(job.inflight)
        ):
            job.unsent = 0
            asyncio.get_running_loop().create_task(self.pool.cut_group(job.task.task_id))

    def _maybe_done(self, job: Job) -> None:
        if job.state == "running" and not job.unsent and not job.inflight:
            self._set_state(job, "completed")

    def _on_update(self, sessions: list[SessionRun]) -> None:
        for s in sessions:
            job = self._owner.get(s.session_id)
            if job is None or self._stages.get(s.session_id) == s.stage:
                continue
            self._stages[s.session_id] = s.stage
            if s.stage in STAGE_STATUS:
                self._publish_session(job, s.session_id, STAGE_STATUS[s.stage])
            if s.stage in ("post", "done") and self._wake is not None:
                self._wake.set()  # its RUN slot is free

    async def _finished(self, job: Job, s: SessionRun) -> None:
        try:
            traces, problem = await self.pool.traces(s, job.request.builder.strategy), None
        except Exception as exc:  # noqa: BLE001 — a session whose records cannot be merged is an ERROR, named
            traces, problem = [], f"its records could not be merged: {exc}"
        result = self._result(job, s, traces, problem)
        async with job.writing:  # the file and the status list the results in one order
            row = result.model_dump(mode="json")
            await asyncio.to_thread(layout.append_line, job.folder / layout.RESULTS_FILE, row)
            job.results[result.session_id] = result  # reported only once it is on disk
        self._publish_session(job, result.session_id, result.status, reward=_reward(result))
        if job.request.callback_url:
            sending = asyncio.create_task(_post_with_retries(job.request.callback_url, result))
            self._callbacks.add(sending)
            sending.add_done_callback(self._callbacks.discard)

    def _result(self, job: Job, s: SessionRun, traces: list[Trace], problem: str | None) -> SessionResult:
        status = OUTCOME_STATUS.get(s.status, SessionStatus.ERROR)
        error = None if status is SessionStatus.COMPLETED else f"{s.status}: {s.eval_output[-500:]}".strip()
        if problem is not None:
            status, error = SessionStatus.ERROR, problem
        return SessionResult(
            session_id=s.session_id,
            task_id=job.request.task_id,
            status=status,
            trajectory=Trajectory(
                status=status.value,
                traces=traces,
                error=error,
                metadata={"reward": s.reward, "outcome": s.status, "exit_code": s.exit_code},
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

    def _set_state(self, job: Job, state: str, **extra: Any) -> None:
        job.state = state
        layout.write_durable(job.folder / layout.STATE_FILE, json.dumps({"status": state, **extra}))
        self.events.publish({"type": "task", "task_id": job.request.task_id, "status": state})


def _reward(result: SessionResult) -> float | None:
    return result.trajectory.metadata.get("reward")


def _timing(s: SessionRun) -> SessionTiming:
    def ms(stage: str) -> float:
        seconds = s.seconds(stage)
        return round(seconds * 1000, 1) if seconds is not None else 0.0

    spans = list(s.spans.values())
    e2e = (max(e for _, e in spans) - min(b for b, _ in spans)) * 1000 if spans else 0.0
    return SessionTiming(init_ms=ms("init"), run_ms=ms("run"), postrun_ms=ms("post"), e2e_ms=round(e2e, 1))


async def _post_with_retries(url: str, result: SessionResult) -> None:
    """POST a finished session to the task's callback, retried with backoff (0.5 s, 1 s, 2 s, 4 s); never raises."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        for attempt in range(CALLBACK_TRIES):
            try:
                response = await client.post(url, content=result.model_dump_json(), headers=_JSON)
                if response.status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            if attempt + 1 < CALLBACK_TRIES:
                await asyncio.sleep(0.5 * 2**attempt)
    logger.warning(
        "callback %s: gave up on session %s after %d tries", url, result.session_id, CALLBACK_TRIES
    )


_JSON = {"content-type": "application/json"}
__all__ = ["Conflict", "HarnessSpecError", "QueueFull", "RequestError", "RolloutService"]
