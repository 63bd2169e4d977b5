"""The rollout service's HTTP routes (Starlette), in Polar's wire format:

    POST   /rollout/task/submit     TaskRequest → {task_id, status: running}   422 bad field · 409 running · 429 full
    GET    /rollout/task/{task_id}  TaskStatus                                  404 unknown
    DELETE /rollout/task/{task_id}  cancel: harnesses stopped, finished sessions kept → TaskStatus
    GET    /events                  server-sent events: every task and session state change (?type=task: tasks only)
    POST   /rollout/weights         {path, weight_version?}: the engine loads a checkpoint → {weight_version}
    GET    /health                  sessions, tasks, the engine's weight_version, what the gateways are given

Every route wants `Authorization: Bearer TOKEN` when the service has a token (401 otherwise; compared in constant
time). A request body that does not parse is a 422 whose `detail` lists each field at fault.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable
from contextlib import asynccontextmanager

import anyio
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from polar_mitm.rollout.harness_spec import HarnessSpecError
from polar_mitm.service.jobs import Conflict, QueueFull, RolloutService
from polar_mitm.service.models import SubmitAccepted, TaskRequest, WeightsUpdate
from polar_mitm.service.task_requests import RequestError

RETRY_AFTER_S = 5
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def build_app(
    service: RolloutService, token: str | None, stopping: Callable[[], bool] = lambda: False
) -> Starlette:
    """The routes over `service`; `stopping` says the server is shutting down (an `/events` stream then ends,
    instead of holding the shutdown until its grace runs out)."""

    def authorized(request: Request) -> bool:
        if token is None:
            return True
        given = request.headers.get("authorization", "")
        return secrets.compare_digest(given.encode(), f"Bearer {token}".encode())

    def guarded(handler):
        async def route(request: Request) -> Response:
            if not authorized(request):
                return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
            return await handler(request)

        return route

    async def submit(request: Request) -> Response:
        try:
            task = TaskRequest.model_validate_json(await request.body())
            await service.submit(task)
        except ValidationError as exc:
            return JSONResponse({"detail": _fields(exc)}, status_code=422)
        except (RequestError, HarnessSpecError) as exc:
            return JSONResponse({"detail": str(exc)}, status_code=422)
        except Conflict as exc:
            return JSONResponse({"detail": str(exc)}, status_code=409)
        except QueueFull as exc:
            headers = {"retry-after": str(RETRY_AFTER_S)}
            return JSONResponse({"detail": str(exc)}, status_code=429, headers=headers)
        return JSONResponse(SubmitAccepted(task_id=task.task_id).model_dump())

    async def get_task(request: Request) -> Response:
        status = await service.status(request.path_params["task_id"])
        if status is None:
            return JSONResponse({"detail": "task not found"}, status_code=404)
        return Response(status.model_dump_json(), media_type="application/json")

    async def cancel_task(request: Request) -> Response:
        status = await service.cancel(request.path_params["task_id"])
        if status is None:
            return JSONResponse({"detail": "task not found"}, status_code=404)
        return Response(status.model_dump_json(), media_type="application/json")

    async def events(request: Request) -> Response:
        # ?type=task (repeatable): only those events — a trainer waiting for whole tasks is not sent (and cannot
        # fall behind on) every session's stage changes
        kinds = frozenset(request.query_params.getlist("type"))

        async def stream():
            yield ": polar-mitm rollout events\n\n"
            async for event in service.events.stream(stopping, kinds):
                yield f"id: {event['id']}\nevent: {event['type']}\ndata: {json.dumps(event, default=str)}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def weights(request: Request) -> Response:
        try:
            update = WeightsUpdate.model_validate_json(await request.body())
        except ValidationError as exc:
            return JSONResponse({"detail": _fields(exc)}, status_code=422)
        if service.engine_url is None:
            return JSONResponse({"detail": "this service was given no engine to push to"}, status_code=409)
        from polar_mitm.engines import weights as engine_weights

        try:
            report = await asyncio.to_thread(
                engine_weights.push_weights_reported,
                service.engine_url,
                update.path,
                weight_version=update.weight_version,
            )
        except Exception as exc:  # noqa: BLE001 — the engine's refusal, said to the caller
            return JSONResponse({"detail": f"{type(exc).__name__}: {exc}"}, status_code=502)
        service.weights_pushed(
            report.weight_version
        )  # tasks waiting for it (metadata.min_weight_version) start now
        # what the push cost running sessions (pause_seconds, mode) beside the version: the loop reports it
        return JSONResponse(report.as_json())

    async def health(request: Request) -> Response:
        """The service's state, with the weight version its engine serves (what a trainer resumes from)."""
        answer = service.health()
        if service.engine_url is not None:
            from polar_mitm.engines import weights as engine_weights

            try:
                answer["weight_version"] = await asyncio.to_thread(
                    engine_weights.common_weight_version, service.engine_url
                )
            except Exception as exc:  # noqa: BLE001 — an engine that does not answer is said, not raised
                answer["weight_version"], answer["engine_error"] = None, f"{type(exc).__name__}: {exc}"
        return JSONResponse(answer)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        # anyio loads its asyncio backend on first use (~0.1 s of imports): now, not on the first /events stream,
        # where it held up every running session (benchmarks/bench_service.py)
        await anyio.sleep(0)
        await service.start()
        try:
            yield
        finally:
            await service.close()

    routes = [
        Route("/rollout/task/submit", guarded(submit), methods=["POST"]),
        Route("/rollout/task/{task_id:path}", guarded(get_task), methods=["GET"]),
        Route("/rollout/task/{task_id:path}", guarded(cancel_task), methods=["DELETE"]),
        Route("/events", guarded(events), methods=["GET"]),
        Route("/rollout/weights", guarded(weights), methods=["POST"]),
        Route("/health", guarded(health), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def _fields(exc: ValidationError) -> list[dict]:
    """Each problem with the field it is at (`num_samples`, `agent.harness`), as FastAPI reports them."""
    return [
        {"loc": list(error["loc"]), "field": ".".join(str(p) for p in error["loc"]), "msg": error["msg"]}
        for error in exc.errors(include_url=False, include_input=False)
    ]
