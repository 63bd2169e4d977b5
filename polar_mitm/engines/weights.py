"""The engines' weights: the `weight_version` each serves, and weight pushes — to one engine, or to every worker of
an engine set (`engines/router.py`), each checked afterwards.

A weight push is `POST /update_weights_from_disk` (SGLang's endpoint, also served by `polar-mitm serve`). The engine's
`weight_version` then shows up in every new record, which is how training later measures how stale a rollout is.
vLLM is pushed differently (pause, reload in place, resume: `engines/dialects/vllm.py`). Which dialect an engine
speaks is asked of it (`dialect_at`: `/model_info` answers on SGLang and the embedded engine, `/version` on vLLM);
the dialect says what to send, `HttpxEngine` here sends it (blocking httpx calls with the engine's key).

Behind a router every worker is pushed, and each worker's `weight_version` is read back afterwards: a worker that is
down or lags fails the push with its URL in the message.

A push lands under running calls (issue 43): each dialect pauses with the calls kept, or swaps between two tokens,
or aborts them for the gateway to resume, and says what that cost the running calls (`PushReport.pause_seconds`).
`push_weights_reported` returns that report (behind a router: the longest pause of the workers);
`push_weights` only the new version.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from polar_mitm.engines.dialects import (
    DEFAULT_DIALECT,
    DIALECTS,
    MODEL_INFO_PATH,
    SERVER_VERSION_PATH,
    engine_kind,
)
from polar_mitm.engines.dialects.base import (
    EngineDialect,
    EngineSyncError,
    PushReport,
    next_version,
    weight_version_of,
)
from polar_mitm.engines.keys import auth_headers
from polar_mitm.engines.router import EngineSetError, engine_workers, model_info


class HttpxEngine:
    """Blocking calls to one engine (`dialects.base.BlockingEngine`): its API key sent, failures `EngineSyncError`."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def get_json(self, path: str, *, timeout: float) -> Any:
        try:
            response = httpx.get(f"{self.url}{path}", timeout=timeout, headers=auth_headers(self.url))
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineSyncError(f"cannot read {self.url}{path}: {exc}") from exc
        return response.json()

    def post(self, path: str, body: dict[str, Any] | None, *, timeout: float) -> httpx.Response:
        try:
            return httpx.post(f"{self.url}{path}", json=body, timeout=timeout, headers=auth_headers(self.url))
        except httpx.HTTPError as exc:
            raise EngineSyncError(f"cannot reach {self.url}{path}: {exc}") from exc


def worker_versions(workers: list[str], *, timeout: float = 10.0) -> dict[str, str | None]:
    """Each worker's `weight_version` (None: the worker did not answer)."""

    def version(url: str) -> str | None:
        try:
            return weight_version_of(model_info(url, timeout=timeout))
        except (EngineSetError, ValueError):
            return None

    with ThreadPoolExecutor(max_workers=max(len(workers), 1)) as pool:
        return dict(zip(workers, pool.map(version, workers), strict=True))


def common_weight_version(spec: str) -> str | None:
    """The weight_version every engine of `spec` serves; None if none answers. Engines that disagree → error."""
    versions = worker_versions(engine_workers(spec))
    seen = {v for v in versions.values() if v is not None}
    if len(seen) > 1:
        raise EngineSetError(
            "engines serve different weights: " + ", ".join(f"{url} at {v}" for url, v in versions.items())
        )
    return seen.pop() if seen else None


def engine_weight_version(engine_url: str, *, timeout: float = 30.0) -> str | None:
    """The engine's current `weight_version` (GET its dialect's version path: SGLang's /model_info, vLLM's
    /weight_info)."""
    return dialect_at(engine_url, timeout=timeout).read_weight_version(
        HttpxEngine(engine_url), timeout=timeout
    )


def dialect_at(engine_url: str, *, timeout: float = 10.0) -> EngineDialect:
    """The dialect of the engine at `engine_url`, asked of it: an answer to `/model_info` (SGLang, the embedded
    engine; a body that is not JSON counts as SGLang's), else to vLLM's `/version`, else SGLang's."""
    base = engine_url.rstrip("/")
    try:
        headers = auth_headers(base)
        answer = httpx.get(f"{base}{MODEL_INFO_PATH}", timeout=timeout, headers=headers)
        if answer.status_code == 200:
            return DIALECTS[engine_kind(_json_or_empty(answer), None)]
        version = httpx.get(f"{base}{SERVER_VERSION_PATH}", timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        raise EngineSyncError(f"cannot reach {engine_url}: {exc}") from exc
    return DIALECTS[engine_kind(None, version.text)] if version.status_code == 200 else DEFAULT_DIALECT


def _json_or_empty(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def push_weights(
    engine_url: str, model_dir: str | Path, *, weight_version: str | None = None, timeout: float = 600.0
) -> str:
    """Load `model_dir` into the engine(s) of `engine_url`; return the new weight_version (`push_weights_reported`
    says what the push cost the running calls as well)."""
    return push_weights_reported(
        engine_url, model_dir, weight_version=weight_version, timeout=timeout
    ).weight_version


def push_weights_reported(
    engine_url: str, model_dir: str | Path, *, weight_version: str | None = None, timeout: float = 600.0
) -> PushReport:
    """Load `model_dir` into the engine(s) of `engine_url`; what was done (`PushReport`: the new version, the pause
    running calls saw, how they were treated).

    `engine_url` may be SGLang's router or a comma list of engines: the router does not forward weight updates, so
    every worker is pushed and checked (`push_to_workers`; a lagging worker raises, named).
    """
    workers = engine_workers(engine_url)
    if workers != [engine_url.rstrip("/")]:
        return push_to_workers(workers, model_dir, weight_version=weight_version, timeout=timeout)
    return push_weights_to_engine(engine_url, model_dir, weight_version=weight_version, timeout=timeout)


def push_weights_to_engine(
    engine_url: str, model_dir: str | Path, *, weight_version: str | None = None, timeout: float = 600.0
) -> PushReport:
    """Tell the one engine at `engine_url` to load the checkpoint in `model_dir`, in its dialect.

    `model_dir` must be readable by the engine at that path (same machine or a shared filesystem).
    """
    dialect = dialect_at(engine_url)
    return dialect.push_weights(
        HttpxEngine(engine_url), model_dir, weight_version=weight_version, timeout=timeout
    )


def push_to_workers(
    workers: list[str], model_dir: str | Path, *, weight_version: str | None = None, timeout: float = 600.0
) -> PushReport:
    """Load `model_dir` into every worker (in parallel), then check each one serves the same new version.

    Raises `EngineSyncError` naming every worker that is down, refused, or reports another version — after the
    others were pushed, so the message also says which workers do hold the new weights. The report: the longest
    pause and push of the workers.
    """
    if weight_version is None:
        weight_version = next_version(worker_versions(workers))

    def push(url: str) -> PushReport | str:
        try:
            return push_weights_to_engine(url, model_dir, weight_version=weight_version, timeout=timeout)
        except EngineSyncError as exc:
            return str(exc)

    with ThreadPoolExecutor(max_workers=len(workers)) as pool:
        outcomes = dict(zip(workers, pool.map(push, workers), strict=True))
    versions = worker_versions(workers)
    expected = weight_version or next(iter(v for v in versions.values() if v is not None), None)
    problems = []
    for url in workers:
        if isinstance(outcomes[url], str):
            problems.append(f"worker {url} did not take the weights: {outcomes[url]}")
        elif versions[url] != expected:
            state = "is down" if versions[url] is None else f"serves weight_version {versions[url]}"
            problems.append(f"worker {url} {state}, expected {expected}")
    if problems:
        current = [
            url for url in workers if isinstance(outcomes[url], PushReport) and versions[url] == expected
        ]
        raise EngineSyncError("; ".join(problems) + f" (up to date: {', '.join(current) or 'none'})")
    reports = [r for r in outcomes.values() if isinstance(r, PushReport)]
    return PushReport(
        str(expected),
        max(r.pause_seconds for r in reports),
        reports[0].mode,
        max(r.seconds for r in reports),
    )
