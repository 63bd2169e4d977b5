"""`Client` and `AsyncClient`: what a trainer calls to get rollouts from the service (httpx; the wire models).

    client = Client("http://127.0.0.1:8700", token=os.environ["POLAR_SERVICE_TOKEN"])
    client.submit(request)                       # a TaskRequest (or its dict); 4xx raise ServiceError
    client.submit_many(requests)                 # a batch, SUBMIT_PARALLEL submits in flight at once
    status = client.wait(request.task_id)        # polls until completed or failed
    batch = to_tensors([status])                 # ids, masks, old logprobs, rewards, group index

`results(task_ids)` yields each task's status as it finishes (a GRPO group at a time), in finishing order.
`AsyncClient.submit` waits out what a retry can cure, for at most `submit_wait` seconds: a refused connection (the
service is not up yet) and a 429 or 503 (its queue is full; its `Retry-After` is honoured). Nothing else is retried:
a 4xx says the request is wrong. A loop of our own rather than tenacity: the verl bridge uses this client in verl's
environment, which installs polar-mitm without its dependencies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import numpy as np

from polar_mitm.service.models import LAGGED_EVENT, SubmitAccepted, TaskRequest, TaskStatus

log = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """A refusal of the service: its status code and what it said (the field at fault, for a 422), and its
    `Retry-After` in seconds where it sent one (a 429)."""

    def __init__(self, status_code: int, detail: Any, retry_after: float | None = None) -> None:
        super().__init__(f"{status_code}: {detail}")
        self.status_code, self.detail, self.retry_after = status_code, detail, retry_after


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def _body(request: TaskRequest | dict) -> bytes:
    model = request if isinstance(request, TaskRequest) else TaskRequest.model_validate(request)
    return model.model_dump_json().encode()


def _checked(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = response.text
        raise ServiceError(response.status_code, detail, _retry_after(response.headers.get("retry-after")))
    return response.json()


def _retry_after(value: str | None) -> float | None:
    """A `Retry-After` header in seconds from now: delay-seconds or an HTTP date (RFC 9110 10.2.3)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds())
    except (TypeError, ValueError):
        return None


SUBMIT_PARALLEL = 8  # submits in flight at once (`submit_many`): each waits for the service's durable write
RETRIED_STATUS = (429, 503)  # the task was not taken: the queue is full, or the service not ready
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 8.0  # where the service gave no Retry-After (a refused connection)


class SubmitRetries:
    """The waits of one submit: a refused connection (nothing was sent) and a 429/503 are retried with backoff
    (the service's `Retry-After` where it gave one) until `patience` seconds have passed; anything else is final."""

    def __init__(self, patience: float) -> None:
        self.deadline = time.monotonic() + patience
        self.attempts = 0

    def delay(self, exc: Exception) -> float | None:
        """Seconds to wait before submitting again after `exc`, or None: raise it."""
        if isinstance(exc, ServiceError):
            if exc.status_code not in RETRIED_STATUS:
                return None
            asked = exc.retry_after
        elif isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            asked = None
        else:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**self.attempts)
        self.attempts += 1
        wait = min(left, asked if asked is not None else backoff)
        log.info("submit: %s; again in %.1f s (%.0f s left)", exc, wait, left)
        return wait


class Client:
    """Blocking calls to a rollout service."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0) -> None:
        self.http = httpx.Client(
            base_url=url.rstrip("/"), headers=_headers(token), timeout=timeout, trust_env=False
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.http.close()

    def submit(self, request: TaskRequest | dict) -> SubmitAccepted:
        response = self.http.post("/rollout/task/submit", content=_body(request), headers=_JSON)
        return SubmitAccepted.model_validate(_checked(response))

    def submit_many(
        self,
        requests: Iterable[TaskRequest | dict],
        *,
        parallel: int = SUBMIT_PARALLEL,
        retry_full: float | None = None,
    ) -> list[SubmitAccepted]:
        """Every request submitted, `parallel` at once, the answers in request order. Each submit is answered once
        the service has it on disk, so one at a time a batch waits for every write in turn (64 tasks under load:
        1.8 s one at a time, 0.55 s eight at once: benchmarks/bench_service.py). A refusal is raised once the
        others are answered; `retry_full`: a full queue (429) is waited out, submitting again every that many s."""

        def one(request: TaskRequest | dict) -> SubmitAccepted:
            while True:
                try:
                    return self.submit(request)
                except ServiceError as exc:
                    if retry_full is None or exc.status_code != 429:
                        raise
                    time.sleep(retry_full)

        with ThreadPoolExecutor(max(parallel, 1), thread_name_prefix="polar-submit") as pool:
            return list(pool.map(one, requests))

    def status(self, task_id: str) -> TaskStatus:
        return TaskStatus.model_validate(_checked(self.http.get(f"/rollout/task/{task_id}")))

    def cancel(self, task_id: str) -> TaskStatus:
        return TaskStatus.model_validate(_checked(self.http.delete(f"/rollout/task/{task_id}")))

    def health(self) -> dict[str, Any]:
        return _checked(self.http.get("/health"))

    def push_weights(self, path: str, weight_version: str | None = None) -> str:
        return self.push_weights_reported(path, weight_version)["weight_version"]

    def push_weights_reported(self, path: str, weight_version: str | None = None) -> dict[str, Any]:
        """The push and what it cost the running sessions: {weight_version, pause_seconds, mode, seconds}."""
        body = {"path": path, "weight_version": weight_version}
        return _checked(self.http.post("/rollout/weights", json=body, timeout=600))

    def wait(self, task_id: str, *, timeout: float = 3600.0, poll: float = 0.5) -> TaskStatus:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status(task_id)
            if status.status != "running":
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"task {task_id!r} still running after {timeout:.0f} s")
            time.sleep(poll)

    def results(self, task_ids: Iterable[str], *, timeout: float = 3600.0) -> Iterator[TaskStatus]:
        """Each task's final status as it finishes (completed or failed), in finishing order: told by `/events`,
        so each task's status is fetched once, not polled (and each asked after once more when listening starts,
        in case it finished before)."""
        return self._finishing(set(task_ids), timeout, submit=None)

    def run(
        self,
        requests: Iterable[TaskRequest | dict],
        *,
        parallel: int = SUBMIT_PARALLEL,
        retry_full: float | None = None,
        timeout: float = 3600.0,
    ) -> Iterator[TaskStatus]:
        """`submit_many(requests)`, then each task's final status as it finishes, as `results` yields them (the
        submits happen when iteration starts). Listening starts before the first submit, so no task has to be asked
        after first: for 64 tasks of short sessions under load that asking cost 4% of the service's sessions/s."""
        models = [r if isinstance(r, TaskRequest) else TaskRequest.model_validate(r) for r in requests]
        return self._finishing(
            {r.task_id for r in models},
            timeout,
            submit=lambda: self.submit_many(models, parallel=parallel, retry_full=retry_full),
        )

    def _finishing(
        self, waiting: set[str], timeout: float, submit: Callable[[], object] | None
    ) -> Iterator[TaskStatus]:
        deadline = time.monotonic() + timeout
        with self.http.stream(
            "GET", "/events", params={"type": "task"}, timeout=httpx.Timeout(timeout, connect=30.0)
        ) as events:
            lines = events.iter_lines()
            next(lines)  # the stream's opening comment: subscribed, so no later change is missed
            if submit is not None:
                submit()
            else:
                yield from self._ask_after(waiting)  # those done before we listened
            if not waiting:  # nothing (left) to wait for: no event need come
                return
            for line in lines:
                if not waiting:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tasks still running after {timeout:.0f} s: {sorted(waiting)}")
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("type") == LAGGED_EVENT:  # the service dropped events we read too slowly to take
                    yield from self._ask_after(waiting)
                elif (
                    event.get("type") == "task"
                    and event.get("task_id") in waiting
                    and event["status"] in FINAL
                ):
                    waiting.discard(event["task_id"])
                    yield self.status(event["task_id"])

    def _ask_after(self, waiting: set[str]) -> Iterator[TaskStatus]:
        """The final status of each task in `waiting` that has finished (taken out of `waiting`)."""
        for task_id in sorted(waiting):
            status = self.status(task_id)
            if status.status in FINAL:
                waiting.discard(task_id)
                yield status


FINAL = ("completed", "failed", "cancelled")


class AsyncClient:
    """The same calls for an asyncio trainer; `submit` waits up to `submit_wait` seconds for a service that is
    not up yet or whose queue is full (see SubmitRetries)."""

    def __init__(
        self, url: str, token: str | None = None, timeout: float = 30.0, submit_wait: float = 60.0
    ) -> None:
        self.http = httpx.AsyncClient(
            base_url=url.rstrip("/"), headers=_headers(token), timeout=timeout, trust_env=False
        )
        self.submit_wait = submit_wait

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.http.aclose()

    async def submit(self, request: TaskRequest | dict) -> SubmitAccepted:
        body, retries = _body(request), SubmitRetries(self.submit_wait)
        while True:
            try:
                response = await self.http.post("/rollout/task/submit", content=body, headers=_JSON)
                return SubmitAccepted.model_validate(_checked(response))
            except (httpx.TransportError, ServiceError) as exc:
                if (wait := retries.delay(exc)) is None:
                    raise
                await asyncio.sleep(wait)

    async def submit_many(
        self, requests: Iterable[TaskRequest | dict], *, parallel: int = SUBMIT_PARALLEL
    ) -> list[SubmitAccepted]:
        """Every request submitted (with `submit`'s waits), `parallel` at once; the answers in request order."""
        slots = asyncio.Semaphore(max(parallel, 1))

        async def one(request: TaskRequest | dict) -> SubmitAccepted:
            async with slots:
                return await self.submit(request)

        return list(await asyncio.gather(*(one(request) for request in requests)))

    async def status(self, task_id: str) -> TaskStatus:
        return TaskStatus.model_validate(_checked(await self.http.get(f"/rollout/task/{task_id}")))

    async def cancel(self, task_id: str) -> TaskStatus:
        return TaskStatus.model_validate(_checked(await self.http.delete(f"/rollout/task/{task_id}")))

    async def wait(self, task_id: str, *, timeout: float = 3600.0, poll: float = 0.5) -> TaskStatus:
        deadline = time.monotonic() + timeout
        while (status := await self.status(task_id)).status == "running":
            if time.monotonic() > deadline:
                raise TimeoutError(f"task {task_id!r} still running after {timeout:.0f} s")
            await asyncio.sleep(poll)
        return status

    async def results(self, task_ids: Iterable[str], *, poll: float = 0.5) -> AsyncIterator[TaskStatus]:
        waiting = list(task_ids)
        while waiting:
            for task_id in list(waiting):
                status = await self.status(task_id)
                if status.status != "running":
                    waiting.remove(task_id)
                    yield status
            if waiting:
                await asyncio.sleep(poll)


def to_tensors(statuses: Iterable[TaskStatus], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Every trace of the finished sessions as a padded batch: `input_ids` (prompt + response), `loss_mask` and
    `old_logprobs` (0 outside sampled tokens), `attention_mask`, `prompt_lengths`, `rewards` and `group_index`
    (one per task: GRPO's groups). Sessions that ended in ERROR are left out."""
    rows: list[tuple[list[int], list[int], list[float], int, float, int]] = []
    for group, status in enumerate(statuses):
        for result in status.results:
            if result.status == "ERROR":
                continue
            for trace in result.trajectory.traces:
                ids = trace.prompt_ids + trace.response_ids
                mask = [0] * len(trace.prompt_ids) + (trace.loss_mask or [1] * len(trace.response_ids))
                logprobs = [0.0] * len(trace.prompt_ids) + (
                    trace.response_logprobs or [0.0] * len(trace.response_ids)
                )
                reward = trace.reward if trace.reward is not None else float("nan")
                rows.append((ids, mask, logprobs, len(trace.prompt_ids), reward, group))
    width = max((len(r[0]) for r in rows), default=0)
    out = {
        "input_ids": np.full((len(rows), width), pad_id, dtype=np.int64),
        "attention_mask": np.zeros((len(rows), width), dtype=np.int64),
        "loss_mask": np.zeros((len(rows), width), dtype=np.int64),
        "old_logprobs": np.zeros((len(rows), width), dtype=np.float32),
        "prompt_lengths": np.array([r[3] for r in rows], dtype=np.int64),
        "rewards": np.array([r[4] for r in rows], dtype=np.float32),
        "group_index": np.array([r[5] for r in rows], dtype=np.int64),
    }
    for k, (ids, mask, logprobs, _, _, _) in enumerate(rows):
        out["input_ids"][k, : len(ids)] = ids
        out["attention_mask"][k, : len(ids)] = 1
        out["loss_mask"][k, : len(ids)] = mask
        out["old_logprobs"][k, : len(ids)] = logprobs
    return out


_JSON = {"content-type": "application/json"}
