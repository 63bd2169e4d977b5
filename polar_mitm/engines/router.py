"""Several engines behind SGLang's router (`smg` / `sglang-router`): which engines an `--engine` value names, start
the router for a list of them, and which engine each gateway should talk to.

`--engine` takes one engine URL, the URL of a running router, or a comma list of engine URLs (then we start the
router: `smg launch --worker-urls … --policy cache_aware`). The router spreads the harnesses' calls over the
engines, but it does **not** forward `POST /update_weights_from_disk` (measured with sglang-router 0.3.2: the
workers stayed at weight_version 0) and answers neither `/model_info` nor `/tokenize` itself (it forwards
`/get_model_info`). So a weight push goes to each worker directly (`engines/weights.py`), and the gateways talk to
the workers when the router drops the token ids they need (`gateway_backends`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from polar_mitm.engines.dialects import DESCRIPTION_PATHS
from polar_mitm.engines.keys import auth_headers
from polar_mitm.processes import children, ports


class EngineSetError(RuntimeError):
    """The engines cannot be used as given (router binary missing, router or worker not coming up)."""


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


class EngineUnreachable(EngineSetError):
    """A given engine URL where nothing answers: said before any session starts (every reward would be 0.0)."""


def check_answering(
    spec: str, *, option: str = "--engine", timeout: float = 5.0, embedded: bool = True
) -> None:
    """Each engine of `spec` (one URL, SGLang's router, or a comma list) answers `/health` (open without a key on
    every engine kind); raises EngineUnreachable naming `option`, the URL and what to do (`embedded`: leaving the
    option out starts one)."""
    for url in split_engine_list(spec) or [spec.rstrip("/")]:
        try:
            status = httpx.get(f"{url}/health", timeout=timeout, headers=auth_headers(url)).status_code
        except httpx.HTTPError as exc:
            fallback = f", or leave {option} out to start the embedded one" if embedded else ""
            raise EngineUnreachable(
                f"{option} {url}: nothing answers at {url}/health ({type(exc).__name__}); start the engine first "
                f"(SGLang, vLLM or `polar-mitm serve`){fallback}"
            ) from None
        if status >= 500:
            raise EngineUnreachable(
                f"{option} {url}: /health answered HTTP {status}: the engine is not ready"
            )


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
    """The engine's model info, whatever its kind (`dialects.DESCRIPTION_PATHS`): `/model_info` (SGLang, polar-mitm
    serve), else `/get_model_info` (the router's), else vLLM's `/weight_info` (its weight version only)."""
    for path in DESCRIPTION_PATHS:
        try:
            response = httpx.get(f"{url.rstrip('/')}{path}", timeout=timeout, headers=auth_headers(url))
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            return response.json()
    raise EngineSetError(f"{url} answers neither /model_info nor /get_model_info")


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
    port = port or ports.free_port()
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
        str(ports.free_port()),
    ]
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        ports.wait_http(f"{url}/readiness", timeout=timeout, proc=proc)
    except BaseException:
        children.stop(proc)
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
        children.stop(engines.router)


@contextmanager
def attached(spec: str, *, log: Path | None = None) -> Iterator[EngineSet]:
    """`attach` for the duration of a block."""
    engines = attach(spec, log=log)
    try:
        yield engines
    finally:
        close(engines)
