"""The engines' weights: the `weight_version` each serves, and weight pushes — to one engine, or to every worker of
an engine set (`engines/router.py`), each checked afterwards.

A weight push is `POST /update_weights_from_disk` (SGLang's endpoint, also served by `polar-mitm serve`). The engine's
`weight_version` then shows up in every new record, which is how training later measures how stale a rollout is.
vLLM (started by `polar-mitm vllm serve`: dev-mode endpoints and our worker extension) is pushed differently: pause
(in-flight calls finish), reload the checkpoint in place through the worker extension (which keeps a tied output head
right; vLLM's own `reload_weights` does not), drop the prefix cache computed with the old weights, set the version,
resume, and read the version back (`push_weights_to_vllm`). Which kind an engine is, is asked of it
(`engine_kind_at`: `/model_info` answers on SGLang and the embedded engine, `/version` on vLLM).

Behind a router every worker is pushed, and each worker's `weight_version` is read back afterwards: a worker that is
down or lags fails the push with its URL in the message.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from polar_mitm.engines.keys import auth_headers
from polar_mitm.engines.router import EngineSetError, engine_workers, model_info


class EngineSyncError(RuntimeError):
    """The engine did not take the new weights (unreachable, or it answered success=false)."""


def weight_version_of(info: Any) -> str | None:
    """The `weight_version` of a `/model_info` answer, as text (None when it has none). Every reader of an engine's
    version — the gateway's per-call read (engines/client.py), the weight pushes here — goes through this."""
    version = info.get("weight_version") if isinstance(info, dict) else None
    return None if version is None else str(version)


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


def next_version(versions: dict[str, str | None]) -> str | None:
    """The version to give every worker when none was asked for: one past the highest numeric one."""
    numbers = [int(v) for v in versions.values() if v is not None and v.isdigit()]
    return str(max(numbers) + 1) if numbers else None


def engine_weight_version(engine_url: str, *, timeout: float = 30.0) -> str | None:
    """The engine's current `weight_version` (GET /model_info; vLLM: GET /weight_info)."""
    path = "/weight_info" if engine_kind_at(engine_url, timeout=timeout) == "vllm" else "/model_info"
    try:
        response = httpx.get(
            f"{engine_url.rstrip('/')}{path}", timeout=timeout, headers=auth_headers(engine_url)
        )
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise EngineSyncError(f"cannot read {engine_url}{path}: {exc}") from exc
    return weight_version_of(response.json())


def engine_kind_at(engine_url: str, *, timeout: float = 10.0) -> str:
    """`vllm` when the engine answers vLLM's `/version` and no `/model_info`; else `sglang` (SGLang, the embedded
    engine: one weight API)."""
    base = engine_url.rstrip("/")
    try:
        headers = auth_headers(base)
        if httpx.get(f"{base}/model_info", timeout=timeout, headers=headers).status_code == 200:
            return "sglang"
        version = httpx.get(f"{base}/version", timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        raise EngineSyncError(f"cannot reach {engine_url}: {exc}") from exc
    return "vllm" if version.status_code == 200 else "sglang"


def _vllm_post(base: str, path: str, body: dict | None, timeout: float) -> httpx.Response:
    try:
        response = httpx.post(f"{base}{path}", json=body, timeout=timeout, headers=auth_headers(base))
    except httpx.HTTPError as exc:
        raise EngineSyncError(f"cannot reach {base}{path}: {exc}") from exc
    if response.status_code != 200:
        raise EngineSyncError(f"{base}{path} refused: HTTP {response.status_code} {response.text[:500]}")
    return response


def push_weights_to_vllm(
    engine_url: str, model_dir: str | Path, *, weight_version: str | None = None, timeout: float = 600.0
) -> str:
    """Load the checkpoint in `model_dir` into the vLLM engine at `engine_url`; return its new weight_version.

    Needs `polar-mitm vllm serve` (VLLM_SERVER_DEV_MODE=1 and `PolarWorkerExtension`). Calls in flight finish
    first (`/pause?mode=wait`); new ones wait until `/resume`, which is sent however the reload went.
    """
    base = engine_url.rstrip("/")
    current = engine_weight_version(base)
    version = str(weight_version or next_version({base: current}) or "1")
    if version == current:
        raise EngineSyncError(
            f"{base} already serves weight_version {version}: a push must carry a new label"
        )
    _vllm_post(base, "/pause?mode=wait", None, timeout)
    try:
        rpc = {
            "method": "polar_reload_weights",
            "kwargs": {
                "weights_path": str(Path(model_dir).resolve()),
                "weight_version": version,
                "current_version": current,
            },
            "timeout": timeout,
        }
        results = _vllm_post(base, "/collective_rpc", rpc, timeout).json().get("results")
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise EngineSyncError(f"{base} did not reload {model_dir}: {results!r:.500}")
        _vllm_post(base, "/reset_prefix_cache", None, timeout)  # cached prefixes hold the old weights' keys
        _vllm_post(base, "/update_weight_version", {"new_version": version}, timeout)
    finally:
        _vllm_post(base, "/resume", None, timeout)
    served = engine_weight_version(base)
    if served != version:
        raise EngineSyncError(f"{base} serves weight_version {served} after the push, expected {version}")
    return version


def push_weights(
    engine_url: str, model_dir: str | Path, *, weight_version: str | None = None, timeout: float = 600.0
) -> str:
    """Load `model_dir` into the engine(s) of `engine_url`; return the new weight_version.

    `engine_url` may be SGLang's router or a comma list of engines: the router does not forward weight updates, so
    every worker is pushed and checked (`push_to_workers`; a lagging worker raises, named).
    """
    workers = engine_workers(engine_url)
    if workers != [engine_url.rstrip("/")]:
        return push_to_workers(workers, model_dir, weight_version=weight_version, timeout=timeout)
    return push_weights_to_engine(engine_url, model_dir, weight_version=weight_version, timeout=timeout)


def push_weights_to_engine(
    engine_url: str, model_dir: str | Path, *, weight_version: str | None = None, timeout: float = 600.0
) -> str:
    """Tell the one engine at `engine_url` to load the checkpoint in `model_dir`; return its new weight_version.

    `model_dir` must be readable by the engine at that path (same machine or a shared filesystem).
    """
    if engine_kind_at(engine_url) == "vllm":
        return push_weights_to_vllm(engine_url, model_dir, weight_version=weight_version, timeout=timeout)
    before = engine_weight_version(engine_url)
    # Always a label: SGLang keeps the served one when none is given, and records would name the wrong weights.
    weight_version = weight_version or next_version({engine_url: before})
    body: dict[str, str] = {"model_path": str(Path(model_dir).resolve())}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    try:
        response = httpx.post(
            f"{engine_url.rstrip('/')}/update_weights_from_disk",
            json=body,
            timeout=timeout,
            headers=auth_headers(engine_url),
        )
    except httpx.HTTPError as exc:
        raise EngineSyncError(f"cannot reach {engine_url}: {exc}") from exc
    try:
        answer = response.json()
    except ValueError:
        answer = {"success": False, "message": response.text[:500]}
    if response.status_code != 200 or not answer.get("success"):
        raise EngineSyncError(
            f"{engine_url} refused the weights in {model_dir}: "
            f"HTTP {response.status_code} {answer.get('message', '')}"
        )
    # SGLang's answer may omit the version: ask for it.
    served = str(answer.get("weight_version") or engine_weight_version(engine_url) or weight_version or "")
    if served == (before or ""):
        raise EngineSyncError(
            f"{engine_url} took {model_dir} but kept weight_version {served}: push a new label"
        )
    return served


def push_to_workers(
    workers: list[str], model_dir: str | Path, *, weight_version: str | None = None, timeout: float = 600.0
) -> str:
    """Load `model_dir` into every worker (in parallel), then check each one serves the same new version.

    Raises `EngineSyncError` naming every worker that is down, refused, or reports another version — after the
    others were pushed, so the message also says which workers do hold the new weights.
    """
    if weight_version is None:
        weight_version = next_version(worker_versions(workers))

    def push(url: str) -> str | None:
        try:
            push_weights_to_engine(url, model_dir, weight_version=weight_version, timeout=timeout)
            return None
        except EngineSyncError as exc:
            return str(exc)

    with ThreadPoolExecutor(max_workers=len(workers)) as pool:
        errors = dict(zip(workers, pool.map(push, workers), strict=True))
    versions = worker_versions(workers)
    expected = weight_version or next(iter(v for v in versions.values() if v is not None), None)
    problems = []
    for url in workers:
        if errors[url]:
            problems.append(f"worker {url} did not take the weights: {errors[url]}")
        elif versions[url] != expected:
            state = "is down" if versions[url] is None else f"serves weight_version {versions[url]}"
            problems.append(f"worker {url} {state}, expected {expected}")
    if problems:
        current = [url for url in workers if not errors[url] and versions[url] == expected]
        raise EngineSyncError("; ".join(problems) + f" (up to date: {', '.join(current) or 'none'})")
    return str(expected)
