"""Start and stop the embedded engine (`polar-mitm serve`) as a child process, with an API key handed over a pipe.

`engine_running` is the usual way in: an engine URL given by the user is used as it is; otherwise one is started for
the block, healthy before it runs and stopped after. `gateway/processes.py` puts a gateway in front of it
(`engine_and_gateway`).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from polar_mitm.engines import keys as engine_keys
from polar_mitm.processes import children, forkserver, ports, secret_handover

if TYPE_CHECKING:
    from polar_mitm.harness.netns import LoopbackNamespace


def start_engine(
    model: str = "tiny",
    *,
    port: int | None = None,
    log: Path | None = None,
    extra_args: list[str] | None = None,
    timeout: float = 300.0,
    netns: LoopbackNamespace | None = None,
    api_key: str | None = None,
) -> tuple[subprocess.Popen | forkserver.ForkedChild, str]:
    """`polar-mitm serve` in a child process; returns (process, base URL) once /health answers.

    It gets an API key (`api_key`, else a new one) through an inherited pipe, remembered for its URL in this process
    (`engine_keys.key_for`): our gateways and weight pushes send it, nothing else can. With `netns` it runs inside
    that network namespace (its URL is only reachable from there).
    """
    port = port or (netns.free_port() if netns is not None else ports.free_port())
    args = ["--model", model, "--port", str(port), *(extra_args or [])]
    out = open(log, "ab") if log else subprocess.DEVNULL
    key = api_key or engine_keys.new_key()
    handover = secret_handover.Handover({engine_keys.HANDOVER_NAME: key})
    env = {k: v for k, v in os.environ.items() if k != engine_keys.KEY_ENV}  # the pipe's key, not a user's
    try:
        kwargs = handover.popen_kwargs({**env, "HF_HUB_OFFLINE": "1"})
        proc = forkserver.popen_module(
            "polar_mitm.engine.cli",  # `polar-mitm serve` without importing the rest of the CLI
            args,
            env=kwargs["env"],
            stdout=out,
            pass_fds=kwargs["pass_fds"],
            netns=netns,
        )
    finally:
        handover.close()
        if log:
            out.close()
    url = f"http://127.0.0.1:{port}"
    engine_keys.remember(url, key)
    try:
        if netns is not None:  # uvicorn listens only once the model is loaded
            netns.wait_port(port, timeout=timeout, proc=proc)
        else:
            ports.wait_http(f"{url}/health", timeout=timeout, proc=proc)
    except BaseException:
        children.stop(proc)
        raise
    return proc, url


@contextmanager
def engine_running(
    engine: str | None = None,
    *,
    model: str = "tiny",
    log: Path | None = None,
    extra_args: list[str] | None = None,
    netns: LoopbackNamespace | None = None,
) -> Iterator[str]:
    """The engine's base URL for the duration of a block: `engine` when given (not ours: left running), else
    `polar-mitm serve --model MODEL EXTRA_ARGS` started for the block, healthy before it runs, stopped after."""
    if engine is not None:
        yield engine
        return
    proc, url = start_engine(model, log=log, extra_args=extra_args, netns=netns)
    try:
        yield url
    finally:
        children.stop(proc)
        engine_keys.forget(url)
