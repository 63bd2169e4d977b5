"""Start and stop our gateways (`mitmdump -s addon/polar.py`) as child processes, for the demo, tests and rollouts.

`engine_and_gateway` is the usual way in: the engine up (started, or one given by URL) and healthy, then the
gateway in front of it, both down again when the block ends. `engines/processes.py`'s `engine_running` and
`gateway_running` here are its two halves, for callers that keep one engine across several gateways (the RL loop);
`gateways_running` starts several. A `GatewayProcess` is the handle: its URLs, its CA, and `switch` (the control
call that points it at the next records folder).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines import processes as engine_processes
from polar_mitm.gateway import control
from polar_mitm.processes import children, forkserver, ports, secret_handover
from polar_mitm.user_errors import UserInputError

if TYPE_CHECKING:
    from polar_mitm.harness.netns import LoopbackNamespace


GATEWAY_MODULE = "polar_mitm.gateway.launch"  # mitmdump on uvloop (gateway/launch.py)


@dataclass
class GatewayProcess:
    """A running `mitmdump -s addon/polar.py` with a regular (HTTPS_PROXY) and a base-URL listener (our own server,
    or mitmproxy's reverse mode: `base_url_listener`)."""

    proc: subprocess.Popen | forkserver.ForkedChild
    proxy_port: int
    reverse_port: int
    confdir: Path
    out_dir: Path
    control_token: str | None = None  # what its control call must carry (gateway/control.py)
    session_key: str | None = None  # signs its sessions' credentials, when it was started with one

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def reverse_url(self) -> str:
        return f"http://127.0.0.1:{self.reverse_port}"

    @property
    def ca_cert(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def ca_bundle(self) -> Path:
        """System CAs + mitmproxy's CA, for clients that replace rather than extend their trust store."""
        bundle = self.confdir / "ca-bundle.pem"
        if not bundle.exists():
            write_ca_bundle(self.ca_cert, bundle)
        return bundle

    def switch(self, out_dir: Path, options: dict[str, str] | None = None, *, timeout: float = 300.0) -> None:
        """Point the running gateway at another records folder (and these `polar_` options): its journal is
        compacted into the old folder's shards before this returns. Raises RuntimeError when it refuses."""
        if self.control_token is None:
            raise RuntimeError("this gateway was started without a control token")
        body = {"options": {"polar_out": str(out_dir), **(options or {})}}
        try:
            answer = httpx.post(
                f"{self.reverse_url}{control.CONTROL_PATH}",
                json=body,
                headers={control.TOKEN_HEADER: self.control_token},
                timeout=timeout,
                trust_env=False,
            )
        except httpx.HTTPError as exc:
            raise RuntimeError(f"gateway control call failed: {exc!r}") from exc
        if answer.status_code != 200:
            raise RuntimeError(f"gateway refused the switch ({answer.status_code}): {answer.text[:300]}")
        self.out_dir = Path(out_dir)

    def stop(self) -> None:
        children.stop(self.proc, timeout=20)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def write_ca_bundle(ca_cert: Path, bundle: Path) -> Path:
    """Write system CAs (certifi's when the system has none) + `ca_cert` to `bundle`."""
    import certifi

    system = Path("/etc/ssl/certs/ca-certificates.crt")
    base = system.read_bytes() if system.exists() else Path(certifi.where()).read_bytes()
    bundle.write_bytes(base + b"\n" + ca_cert.read_bytes())
    return bundle


def addon_path() -> Path:
    return Path(__file__).resolve().parents[2] / "addon" / "polar.py"


def mitmdump_command(
    backend: str,
    out_dir: Path,
    confdir: Path,
    proxy_port: int,
    reverse_port: int,
    options: dict[str, str] | None,
) -> list[str]:
    """The gateway's command line: the polar addon on mitmdump, both modes, `options` as `--set key=value`."""
    cmd = [
        sys.executable,
        "-m",
        GATEWAY_MODULE,
        "-q",
        "-s",
        str(addon_path()),
        "--mode",
        f"regular@{proxy_port}",
        *base_url_listener(reverse_port, "http://127.0.0.1:9", options or {}),
        "--set",
        f"confdir={confdir}",
        "--set",
        f"polar_backend={backend}",
        "--set",
        f"polar_out={out_dir}",
        "--set",
        "connection_strategy=lazy",
    ]
    for key, value in (options or {}).items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


BASE_URL_SERVER_ENV = "POLAR_BASE_URL_SERVER"  # `mitmproxy`: base URLs through mitmproxy's reverse mode


def base_url_listener(port: int, dead_upstream: str, option_names: Iterable[str]) -> list[str]:
    """mitmdump's arguments for the base-URL listener: the gateway's own server (`polar_base_url_port`,
    gateway/base_url_server.py), or mitmproxy's reverse mode where flows are saved (`-w` files are mitmproxy's) or
    `$POLAR_BASE_URL_SERVER=mitmproxy` asks for it. Nothing is forwarded to `dead_upstream`."""
    chosen = os.environ.get(BASE_URL_SERVER_ENV, "polar") or "polar"
    if chosen not in ("polar", "mitmproxy"):
        raise UserInputError(f"${BASE_URL_SERVER_ENV}={chosen!r}: use `polar` (the default) or `mitmproxy`")
    if chosen == "mitmproxy" or "save_stream_file" in set(option_names):
        return ["--mode", f"reverse:{dead_upstream}@{port}"]
    return ["--set", f"polar_base_url_port={port}"]


def start_gateway(
    backend: str,
    out_dir: Path,
    *,
    confdir: Path,
    log: Path | None = None,
    options: dict[str, str] | None = None,
    proxy_port: int | None = None,
    reverse_port: int | None = None,
    netns: LoopbackNamespace | None = None,
    tie_to_parent: bool = False,
    engine_key: str | None = None,
    session_key: str | None = None,
) -> GatewayProcess:
    """mitmdump with the polar addon in regular and reverse mode at once (inside `netns` when given).

    `tie_to_parent`: the gateway gets SIGTERM (and compacts its journal) when the process that started it dies.
    Its control token, `engine_key` (the engine's API key) and `session_key` (what signs session credentials)
    reach it through an inherited pipe (`secret_handover`), never its environment or command line.
    """
    free_port = netns.free_port if netns is not None else ports.free_port
    proxy_port, reverse_port = proxy_port or free_port(), reverse_port or free_port()
    cmd = mitmdump_command(backend, out_dir, confdir, proxy_port, reverse_port, options)
    out = open(log, "ab") if log else subprocess.DEVNULL
    token = secrets.token_urlsafe(24)
    engine_key = engine_key or engine_keys.key_for(backend)  # the key of an engine this process started
    handover = secret_handover.Handover(
        {"control_token": token, "engine_key": engine_key, "session_key": session_key}
    )
    try:
        kwargs = handover.popen_kwargs(dict(os.environ))
        assert cmd[:3] == [sys.executable, "-m", GATEWAY_MODULE]
        proc = forkserver.popen_module(
            GATEWAY_MODULE,
            cmd[3:],
            env=kwargs["env"],
            stdout=out,
            pass_fds=kwargs["pass_fds"],
            netns=netns,
            tie_to_parent=tie_to_parent,
        )
    finally:
        handover.close()
        if log:
            out.close()
    wait = netns.wait_port if netns is not None else ports.wait_port
    try:
        wait(proxy_port, proc=proc)
        wait(reverse_port, proc=proc)
        # Inside a namespace its URL is not reachable from here, and with a flow file (`save_stream_file`, `-w`)
        # every probe would be saved among the user's flows: then the first calls wait for the load instead.
        if netns is None and "save_stream_file" not in (options or {}):
            wait_gateway_ready(f"http://127.0.0.1:{reverse_port}", proc=proc)
    except BaseException:
        children.stop(proc)
        raise
    return GatewayProcess(proc, proxy_port, reverse_port, Path(confdir), Path(out_dir), token, session_key)


GATEWAY_READY_PATH = "/_polar/ready"  # gateway/service.py answers it


def wait_gateway_ready(
    base_url: str, *, timeout: float = 120.0, proc: subprocess.Popen | None = None
) -> None:
    """Poll the gateway's readiness answer until it says a model call would not wait for anything to load
    (tokens mode: the engine's tokenizer and chat template loaded); fail fast if `proc` dies."""
    deadline = time.monotonic() + timeout
    # One client for the whole wait: `httpx.get` builds a client, hence an SSL context (the CA file parsed), per
    # call — 26 ms of CPU per poll, so polling every 20 ms took half a core from the gateway it waits for (and the
    # engine's start); a reused client polls for ~1 ms.
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {proc.returncode} before it was ready")
            try:
                if client.get(base_url + GATEWAY_READY_PATH).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    raise TimeoutError(f"the gateway at {base_url} was not ready in {timeout:.0f}s")


@contextmanager
def gateway_running(
    backend: str,
    out_dir: Path,
    *,
    confdir: Path,
    log: Path | None = None,
    options: dict[str, str] | None = None,
    netns: LoopbackNamespace | None = None,
) -> Iterator[GatewayProcess]:
    """`start_gateway` for the duration of a block; stopping it compacts its journal into a shard."""
    gateway = start_gateway(backend, out_dir, confdir=confdir, log=log, options=options, netns=netns)
    try:
        yield gateway
    finally:
        gateway.stop()


@contextmanager
def gateways_running(
    backends: list[str],
    out_dir: Path,
    *,
    confdir: Path,
    log: Path | None = None,
    options: dict[str, str] | None = None,
    session_key: str | None = None,
) -> Iterator[list[GatewayProcess]]:
    """One gateway per backend for the duration of a block (`--gateways N`): tokenization and record writing are
    CPU work in one event loop per process, so several processes serve more sessions at once. One gateway writes
    `out_dir` itself; several write `out_dir/gw-K` each (a journal per process, so no one recovers another's live
    journal; every reader takes the folder whole, as with Ray's `node-*`), logs `gateway-K.log`.

    The first starts alone (it creates the mitmproxy CA in `confdir`, which the others then share), the rest
    together."""
    started = start_gateways(
        backends, out_dir, confdir=confdir, log=log, options=options, session_key=session_key
    )
    try:
        yield started
    finally:
        for gateway in started:  # stopping compacts each journal into a shard
            gateway.stop()


def gateway_folder(out_dir: Path, k: int, n: int) -> Path:
    """Gateway K's records folder of N: `out_dir` itself for one, `out_dir/gw-K` for several."""
    return out_dir / f"gw-{k}" if n > 1 else out_dir


def start_gateways(
    backends: list[str],
    out_dir: Path,
    *,
    confdir: Path,
    log: Path | None = None,
    options: dict[str, str] | None = None,
    session_key: str | None = None,
) -> list[GatewayProcess]:
    """Start one gateway per backend (`gateways_running` says how); the caller stops them. `session_key`: the
    gateways serve only calls carrying a session credential under it (a rollout's, `session_ids.credential`)."""
    from concurrent.futures import ThreadPoolExecutor

    def start(k: int) -> GatewayProcess:
        several = len(backends) > 1
        return start_gateway(
            backends[k],
            gateway_folder(out_dir, k, len(backends)),
            confdir=confdir,
            log=log.with_name(f"{log.stem}-{k}{log.suffix}") if log is not None and several else log,
            options=options,
            session_key=session_key,
        )

    started: list[GatewayProcess] = []
    try:
        started.append(start(0))
        with ThreadPoolExecutor(max_workers=max(1, len(backends) - 1)) as pool:
            futures = [pool.submit(start, k) for k in range(1, len(backends))]
        started += [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            raise failed[0]  # type: ignore[misc]
    except BaseException:
        for gateway in started:
            gateway.stop()
        raise
    return started


@contextmanager
def engine_and_gateway(
    out_dir: Path,
    *,
    confdir: Path,
    engine: str | None = None,
    model: str = "tiny",
    engine_args: list[str] | None = None,
    engine_log: Path | None = None,
    gateway_log: Path | None = None,
    gateway_options: dict[str, str] | None = None,
    netns: LoopbackNamespace | None = None,
) -> Iterator[tuple[str, GatewayProcess]]:
    """(engine URL, gateway) for the duration of a block: the engine up and healthy (`engine_running`), then the
    gateway in front of it writing records to `out_dir`; on exit the gateway goes down first, then the engine.

    Everything runs inside `netns` when given (then its URLs are only reachable from there).
    """
    with (
        engine_processes.engine_running(
            engine, model=model, log=engine_log, extra_args=engine_args, netns=netns
        ) as engine_url,
        gateway_running(
            engine_url, out_dir, confdir=confdir, log=gateway_log, options=gateway_options, netns=netns
        ) as gateway,
    ):
        yield engine_url, gateway
