"""The rollout service's jobs: each submitted task is a GRPO group run by the same staged runner as `polar-mitm
rollout` (INIT → READY → RUN → POST-RUN) against the service's gateways, and each session, as it finishes, becomes
a `SessionResult` — written to disk first, then visible in the task's status, on `/events` and at its callback.

Scheduling: a task starts when the sessions it would run fit in `max_sessions` beside the running ones (or nothing
runs), higher `dispatch_priority` first, then in submission order; at most `queue_limit` tasks wait (a full queue
is `QueueFull`, a 429). `early_stop_min_usable_sessions` is the runner's straggler cut.

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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec, HarnessSpecError
from polar_mitm.rollout.runner import Rollout, RolloutConfig, SessionRun
from polar_mitm.service.models import (
    SessionResult,
    SessionStatus,
    SessionTiming,
    TaskRequest,
    TaskStatus,
    Trajectory,
)
from polar_mitm.service.task_requests import RequestError, request_task
from polar_mitm.service.traces import flows_eot, session_traces
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


class Conflict(Exception):
    """A task with this id is still running (409)."""


class QueueFull(Exception):
    """`queue_limit` tasks already wait (429)."""


@dataclass
class Job:
    request: TaskRequest
    task: Task
    folder: Path
    results: dict[str, SessionResult] = field(default_factory=dict)
    state: str = "queued"  # queued | running | completed | failed | cancelled
    order: int = 0
    runner: asyncio.Task | None = None
    pending: set[asyncio.Task] = field(default_factory=set)  # results being built

    @property
    def remaining(self) -> int:
        return max(self.request.num_samples - len(self.results), 0)

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

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue = asyncio.Queue(maxsize=1000)
        self.subscribers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self.subscribers.discard(queue)


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
    ) -> None:
        self.out, self.endpoints, self.task_root = out, endpoints, task_root
        self.flows = out / layout.FLOWS_DIR
        self.work = out / layout.WORK_DIR
        self.max_sessions, self.queue_limit, self.engine_url = max_sessions, queue_limit, engine_url
        self.jobs: dict[str, Job] = {}
        self.events = EventBus()
        self.order = itertools.count()
        self._wake: asyncio.Event | None = None
        self._dispatcher: asyncio.Task | None = None
        self._callbacks: set[asyncio.Task] = set()
        self._eot: int | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._dispatcher = asyncio.create_task(self._dispatch())
        self._wake.set()

    async def close(self) -> None:
        """Stop dispatching and cancel running tasks (their finished sessions are on disk; `--resume` re-runs the
        rest)."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        running = [
            job.runner for job in self.jobs.values() if job.runner is not None and not job.runner.done()
        ]
        for runner in running:
            runner.cancel()
        await asyncio.gather(*running, *self._callbacks, return_exceptions=True)

    def resume(self) -> int:
        """Load the tasks under OUT/tasks: finished ones as they were, unfinished ones queued for the sessions they
        lack; the number of sessions that will run again."""
        rerun = 0
        for folder in sorted((self.out / layout.TASKS_DIR).glob("*")):
            request = TaskRequest.model_validate_json((folder / layout.REQUEST_FILE).read_text())
            job = Job(request, request_task(request, self.task_root), folder, order=next(self.order))
            for row in layout.read_lines(folder / layout.RESULTS_FILE):
                result = SessionResult.model_validate(row)
                job.results.setdefault(result.session_id, result)
            state = json.loads((folder / layout.STATE_FILE).read_text()).get("status", "running")
            job.state = state if state in ("completed", "failed", "cancelled") else "queued"
            if job.state == "queued":
                rerun += job.remaining
            self.jobs[request.task_id] = job
        if self._wake is not None:
            self._wake.set()
        return rerun

    # -- requests -----------------------------------------------------------------------------------------------

    def submit(self, request: TaskRequest) -> None:
        """Accept a task (on disk before this returns); RequestError, Conflict or QueueFull refuse it."""
        HarnessSpec(request.agent.harness)  # HarnessSpecError: an unknown harness, before anything is kept
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
        self.jobs[request.task_id] = Job(request, task, folder, order=next(self.order))
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
            job.state = "cancelled"
            if job.runner is not None:
                job.runner.cancel()
                await asyncio.gather(job.runner, return_exceptions=True)
            await asyncio.gather(*job.pending, return_exceptions=True)
            self._set_state(job, "cancelled")
        return job.status()

    def health(self) -> dict[str, Any]:
        states = [job.state for job in self.jobs.values()]
        return {
            "status": "ok",
            "tasks": {state: states.count(state) for state in sorted(set(states))},
            "running_sessions": self._running_sessions(),
            "max_sessions": self.max_sessions,
            "gateways": len(self.endpoints),
        }

    # -- running ------------------------------------------------------------------------------------------------

    def _running_sessions(self) -> int:
        return sum(self._width(job) for job in self.jobs.values() if job.state == "running")

    def _width(self, job: Job) -> int:
        return max(1, min(job.remaining, self.max_sessions))

    async def _dispatch(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            queued = sorted(
                (job for job in self.jobs.values() if job.state == "queued"),
                key=lambda job: (-job.request.dispatch_priority, job.order),
            )
            for job in queued:
                running = self._running_sessions()
                if running and running + self._width(job) > self.max_sessions:
                    break  # in priority order: a later, smaller task does not overtake this one
                job.state = "running"
                job.runner = asyncio.create_task(self._run(job))

    async def _run(self, job: Job) -> None:
        try:
            if job.remaining:
                await self._sessions(job)
            await asyncio.gather(*job.pending, return_exceptions=True)
            if job.state == "running":
                self._set_state(job, "completed")
        except asyncio.CancelledError:
            if job.state == "running":  # the service is closing: `--resume` runs the rest
                job.state = "queued"
            raise
        except Exception as exc:  # a bug of ours or a dead gateway: the task fails, the service goes on
            logger.exception("task %s failed", job.request.task_id)
            job.state = "failed"
            self._set_state(job, "failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            assert self._wake is not None
            self._wake.set()

    async def _sessions(self, job: Job) -> None:
        request = job.request
        config = RolloutConfig(
            group_size=job.remaining,
            concurrency=self._width(job),
            init_workers=min(2, job.remaining),
            post_workers=min(2, job.remaining),
            ready_buffer=0,
            keep=request.early_stop_min_usable_sessions,
            workspace_root=self.work / "workspaces",
            log_dir=self.work / "logs",
        )
        rollout = Rollout([job.task], HarnessSpec(request.agent.harness), self.endpoints, config)
        seen: dict[str, str] = {}

        def on_update(sessions: list[SessionRun]) -> None:
            for s in sessions:
                if seen.get(s.session_id) == s.stage:
                    continue
                seen[s.session_id] = s.stage
                if s.stage == "done" and s.status:
                    built = asyncio.get_running_loop().create_task(self._finished(job, s))
                    job.pending.add(built)
                    built.add_done_callback(job.pending.discard)
                elif s.stage in STAGE_STATUS:
                    status = STAGE_STATUS[s.stage]
                    self._publish_session(job, s.session_id, status)

        for s in rollout.sessions:  # the runner says nothing until a session starts
            seen[s.session_id] = s.stage
            self._publish_session(job, s.session_id, SessionStatus.REGISTERED)
        rollout.on_update = on_update
        await rollout.run()

    async def _finished(self, job: Job, s: SessionRun) -> None:
        result = await asyncio.to_thread(self._result, job, s)
        if job.state == "cancelled" and result.session_id in job.results:
            return
        await asyncio.to_thread(layout.append_durable, job.folder / layout.RESULTS_FILE, result.model_dump())
        job.results[result.session_id] = result  # reported only once it is on disk
        self._publish_session(job, result.session_id, result.status, reward=_reward(result))
        if job.request.callback_url:
            sending = asyncio.create_task(_post_with_retries(job.request.callback_url, result))
            self._callbacks.add(sending)
            sending.add_done_callback(self._callbacks.discard)

    def _result(self, job: Job, s: SessionRun) -> SessionResult:
        status = OUTCOME_STATUS.get(s.status, SessionStatus.ERROR)
        if self._eot is None:
            self._eot = flows_eot(self.flows)
        error = None if status is SessionStatus.COMPLETED else f"{s.status}: {s.eval_output[-500:]}".strip()
        try:
            traces = session_traces(
                self.flows, s.session_id, s.reward, job.request.builder.strategy, self._eot
            )
        except Exception as exc:  # noqa: BLE001 — a session whose records cannot be merged is an ERROR, named
            status, error, traces = SessionStatus.ERROR, f"its records could not be merged: {exc}", []
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
