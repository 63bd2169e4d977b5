"""The dashboard's HTTP surface (Starlette): the page and its assets, JSON routes for each page's data, and the
server-sent events stream. Read-only: only GET and HEAD are answered.

    GET /                        the page (assets/index.html); the pages are its #/overview, #/sessions, …
    GET /assets/{name}           its script and style
    GET /api/overview            settings, iterations (loop.json + training metrics), the stage in progress
    GET /api/events              events.jsonl
    GET /api/sessions            a page of sessions: ?offset&limit&sort&desc&q&stage&task_id&status&…
    GET /api/session/{id}        one session: its row, its calls (requests, answers, tokens), its merged sequences
    GET /api/discarded           what did not train, and why
    GET /api/engines             each engine's calls on a time line, the weight pushes
    GET /api/evaluation          held-out pass@k per evaluation and per task
    GET /api/service             the rollout service's tasks
    GET /api/stream              server-sent events: `change` with the parts that changed

With a token (`POLAR_DASHBOARD_TOKEN`), every route wants it: `Authorization: Bearer TOKEN`, or `?token=TOKEN`
once (the page is opened with it; a cookie then carries it, since EventSource cannot send headers). Answers carry
a Content-Security-Policy that allows only this origin's script: a prompt that slipped into the DOM as markup could
still not run.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from polar_mitm.dashboard import calls, figures, timeline
from polar_mitm.dashboard.live import ChangeFeed
from polar_mitm.dashboard.run_files import stage_named
from polar_mitm.dashboard.sessions import FILTERS, SessionIndex, SessionQuery

TOKEN_COOKIE = "polar_dashboard_token"
ASSETS = {"app.js": "text/javascript", "app.css": "text/css", "index.html": "text/html"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def asset(name: str) -> bytes:
    """A file of the page, shipped as package data (no build step, nothing fetched)."""
    return resources.files("polar_mitm.dashboard").joinpath("assets", name).read_bytes()


class TokenGuard(BaseHTTPMiddleware):
    """401 without the token (when one is set); the token given as ?token= is kept in an HttpOnly cookie."""

    def __init__(self, app: Any, token: str | None) -> None:
        super().__init__(app)
        self.token = token

    def _given(self, request: Request) -> tuple[str | None, bool]:
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            return header[7:].strip(), False
        if "token" in request.query_params:
            return request.query_params["token"], True
        return request.cookies.get(TOKEN_COOKIE), False

    async def dispatch(self, request: Request, call_next: Callable) -> Response:
        if request.method not in ("GET", "HEAD"):
            return PlainTextResponse("read-only", status_code=405, headers=SECURITY_HEADERS)
        if self.token:
            given, from_query = self._given(request)
            if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
                return PlainTextResponse("token required", status_code=401, headers=SECURITY_HEADERS)
        response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        if self.token and from_query:
            response.set_cookie(TOKEN_COOKIE, self.token, httponly=True, samesite="strict")
        return response


def _int(request: Request, name: str, default: int) -> int:
    try:
        return int(request.query_params.get(name, default))
    except ValueError:
        return default


def session_query(request: Request) -> SessionQuery:
    params = request.query_params
    return SessionQuery(
        filters={name: params[name] for name in FILTERS if params.get(name)},
        text=params.get("q", "").strip(),
        sort=params.get("sort", "started_at"),
        descending=params.get("desc", "0") in ("1", "true"),
        offset=_int(request, "offset", 0),
        limit=_int(request, "limit", 50),
    )


def dashboard_app(run_dir: Path, *, token: str | None = None, feed: ChangeFeed | None = None) -> Starlette:
    """The app for one run directory; `feed` (made here when not given) is what `cli` tells to stop."""
    run_dir = Path(run_dir)
    index = SessionIndex(run_dir)
    feed = feed or ChangeFeed(run_dir)

    def json_route(read: Callable[[Request], Any]) -> Callable:
        async def endpoint(request: Request) -> Response:
            return JSONResponse(await asyncio.to_thread(read, request))  # file reads off the event loop

        return endpoint

    def session(request: Request) -> Any:
        session_id = request.path_params["session_id"]
        row = index.find(session_id)
        stage = stage_named(run_dir, row["stage"]) if row else None
        if row is None or stage is None:
            raise HTTPException(404, f"no session {session_id}")
        return calls.session_view(stage, row)

    async def page(request: Request) -> Response:
        return Response(asset("index.html"), media_type="text/html")

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return PlainTextResponse("not found", status_code=404)
        return Response(asset(name), media_type=ASSETS[name])

    async def stream(request: Request) -> Response:
        return StreamingResponse(feed.stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    routes = [
        Route("/", page),
        Route("/assets/{name}", static),
        Route("/api/overview", json_route(lambda r: figures.overview(run_dir))),
        Route("/api/events", json_route(lambda r: figures.events(run_dir))),
        Route("/api/sessions", json_route(lambda r: index.page(session_query(r)))),
        Route("/api/session/{session_id:path}", json_route(session)),
        Route("/api/discarded", json_route(lambda r: figures.discarded(run_dir, index))),
        Route("/api/engines", json_route(lambda r: timeline.engines(run_dir))),
        Route("/api/evaluation", json_route(lambda r: figures.evaluations(run_dir))),
        Route("/api/service", json_route(lambda r: figures.service(run_dir))),
        Route("/api/stream", stream),
    ]
    return Starlette(routes=routes, middleware=[Middleware(TokenGuard, token=token)])
