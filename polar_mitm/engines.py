"""The engines we talk to over HTTP: their weight_version, weight pushes, and several engines behind SGLang's router
(`smg` / `sglang-router`): start it, find its workers, push to every one.

A weight push is `POST /update_weights_from_disk` (SGLang's endpoint, also served by `polar-mitm serve`). The engine's
`weight_version` then shows up in every new record, which is how training later measures how stale a rollout is.
vLLM (started by `polar-mitm vllm serve`: dev-mode endpoints and our worker extension) is pushed differently: pause
(in-flight calls finish), reload the checkpoint in place through the worker extension (which keeps a tied output head
right; vLLM's own `reload_weights` does not), drop the prefix cache computed with the old weights, set the version,
resume, and read the version back (`push_weights_to_vllm`). Which kind an engine is, is asked of it
(`engine_kind_at`: `/model_info` answers on SGLang and the embedded engine, `/version` on vLLM).

`--engine` takes one engine URL, the URL of a running router, or a comma list of engine URLs (then we start the
router: `smg launch --worker-urls … --policy cache_aware`). The router spreads the harnesses' calls over the
engines, but it does **not** forward `POST /update_weights_from_disk` (measured with sglang-router 0.3.2: the
workers stayed at weight_version 0) and answers neither `/model_info` nor `/tokenize` itself (it forwards
`/get_model_info`). So a weight push goes to each worker directly, and each worker's `weight_version` is read back
afterwards: a worker that is down or lags fails the push with its URL in the message.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from polar_mitm import procs
from polar_mitm.engine_keys import auth_headers


class EngineSetError(RuntimeError):
    """The engines cannot be used as given (router binary missing, router or worker not coming up)."""


class EngineSyncError(RuntimeError):
    """The engine did not take the new weights (unreachable, or it answered success=false)."""


@dataclass
class EngineSet:
    """What the gateways talk to (`url`: a router or the only engine) and the engines that serve behind it."""

    url: str
    workers: list[str]
    router: subprocess.Popen | None = None  # a router we started (stopped with the set)

    @property
    def routed(self) -> bool:
        return self.url not in self.workers


def split_engine_list(spec: str) -> list[str] | None:
    """`http://a:1,http://b:2` → the URLs (no trailing slash); a single URL → None."""
    if "," not in spec:
        return None
    return [part.strip().rstrip("/") for part in spec.split(",") if part.strip()]


def router_workers(url: str, *, timeout: float = 5.0) -> list[str] | None:
    """The worker URLs behind SGLang's router at `url` (GET /workers), or None when `url` is not a router."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/workers", timeout=timeout, headers=auth_headers(url))
        body = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    workers = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(workers, list):
        return None
    return [str(w["url"]).rstrip("/") for w in workers if isinstance(w, dict) and w.get("url")]


def engine_workers(spec: str) -> list[str]:
    """Every engine a weight push must reach: the list itself, the router's workers, or the one engine."""
    listed = split_engine_list(spec)
    if listed is not None:
        return listed
    return router_workers(spec) or [spec.rstrip("/")]


def model_info(url: str, *, timeout: float = 10.0) -> dict:
    """The engine's model info: `/model_info` (SGLang, polar-mitm serve), else `/get_model_info` (the router's), else
    vLLM's `/weight_info` (its weight version only)."""
    for path in ("/model_info", "/get_model_info", "/weight_info"):
        try:
            response = httpx.get(f"{url.rstrip('/')}{path}", timeout=timeout, headers=auth_headers(url))
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            return response.json()
    raise EngineSetError(f"{url} answers neither /model_info nor /get_model_info")


def weight_version_of(info: Any) -> str | None:
    """The `weight_version` of a `/model_info` answer, as text (None when it has none). Every reader of an engine's
    version — the gateway's per-call read (gateway/engine_client.py), the weight pushes here — goes through this."""
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


def gateway_options(spec: str) -> dict[str, str]:
    """Gateway options an engine set needs: behind a router, the tokenizer path (the router has no /model_info)."""
    workers = engine_workers(spec)
    if workers == [spec.rstrip("/")]:
        return {}
    path = model_info(workers[0]).get("tokenizer_path")
    return {"polar_tokenizer": str(path)} if path else {}


def forwards_token_ids(url: str, *, timeout: float = 60.0) -> bool:
    """Does a chat call through `url` come back with the sampled token ids? (One 1-token call.)

    sglang-router 0.3.2 parses chat requests into its own types and drops `return_token_ids`/`return_meta_info`,
    so its answers carry no ids (measured); the gateway then has to talk to the workers directly.
    """
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
        "return_token_ids": True,
    }
    try:
        answer = httpx.post(
            f"{url.rstrip('/')}/v1/chat/completions", json=body, timeout=timeout, headers=auth_headers(url)
        ).json()
        return "response_token_ids" in answer["choices"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return False


def gateway_backends(spec: str, count: int) -> list[str]:
    """The engine URL for each of `count` gateways: the router when it passes token ids through, else the workers
    in turn (gateway k → worker k mod N), which also keeps each gateway's sessions on one engine's prefix cache."""
    workers = engine_workers(spec)
    if workers == [spec.rstrip("/")] or forwards_token_ids(spec):
        return [spec.rstrip("/")] * count
    return [workers[k % len(workers)] for k in range(count)]


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


def smg_binary() -> str:
    """The router's command: beside this Python (the `cluster` extra installs it), else on PATH."""
    local = Path(sys.executable).with_name("smg")
    found = str(local) if local.exists() else shutil.which("smg") or shutil.which("sglang-router")
    if not found:
        raise EngineSetError("sglang-router is not installed (pip install 'polar-mitm[cluster]')")
    return found


def start_router(
    workers: list[str],
    *,
    port: int | None = None,
    log: Path | None = None,
    policy: str = "cache_aware",
    timeout: float = 120.0,
) -> tuple[subprocess.Popen, str]:
    """`smg launch` in front of `workers`; returns (process, URL) once every worker is healthy behind it."""
    port = port or procs.free_port()
    cmd = [
        smg_binary(),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        "warn",
        # Its metrics listener defaults to port 29000: a second router on the machine would fail to start.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(procs.free_port()),
    ]
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_http(f"{url}/readiness", timeout=timeout, proc=proc)
    except BaseException:
        procs.stop(proc)
        raise
    return proc, url


def attach(spec: str, *, log: Path | None = None) -> EngineSet:
    """The engine set of an `--engine` value; a comma list gets a router started for it (stop with `close`)."""
    listed = split_engine_list(spec)
    if listed is not None:
        proc, url = start_router(listed, log=log)
        return EngineSet(url, listed, proc)
    spec = spec.rstrip("/")
    workers = router_workers(spec)
    return EngineSet(spec, workers) if workers else EngineSet(spec, [spec])


def close(engines: EngineSet) -> None:
    """Stop the router we started (the engines themselves are not ours)."""
    if engines.router is not None:
        procs.stop(engines.router)


@contextmanager
def attached(spec: str, *, log: Path | None = None) -> Iterator[EngineSet]:
    """`attach` for the duration of a block."""
    engines = attach(spec, log=log)
    try:
        yield engines
    finally:
        close(engines)
