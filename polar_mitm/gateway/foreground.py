"""`polar-mitm gateway`: one gateway in the foreground, for harnesses started by hand.

The README's capture quick-start as one command: the engine checked (`--engine URL`) or the embedded one started
(`polar-mitm serve --model tiny`, as `rollout` and `loop` do when no engine is given), then mitmdump with the polar
addon on two listeners — regular (the HTTPS_PROXY hook-up) and reverse (the base-URL hook-up), as every gateway
polar-mitm starts — mitmproxy's CA turned into a bundle of system CAs + it, and the variables of both hook-ups
printed: the same ones the harness presets set (`harness/base.py`: `PROXY_VARS`, `ca_env` of every runtime), and
each SDK's base URL from the codec registry (`codecs.sdk_base_url`).

It then runs until Ctrl-C or SIGTERM, which it hands to mitmdump once as SIGTERM (calls in flight run on for
`polar_shutdown_grace_seconds`, then are recorded `abort`; the journal is compacted into a shard); a second signal
kills mitmdump (its fsynced journal is recovered at the next start). mitmdump runs in a session of its own, so a
terminal's Ctrl-C reaches it only through us, once; mitmdump's exit code is the command's.
"""

from __future__ import annotations

import difflib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, get_args

import typer

from polar_mitm.codecs import sdk_base_url
from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines import router
from polar_mitm.gateway.processes import addon_path, base_url_listener, wait_gateway_ready, write_ca_bundle
from polar_mitm.harness.base import PROXY_VARS, Runtime, ca_env
from polar_mitm.processes import children, secret_handover
from polar_mitm.user_errors import UserInputError

# The reverse listener's upstream: the discard port, where nothing listens. The addon answers model calls itself;
# only `polar_passthrough=upstream` would forward anything there, and that fails at once.
DEAD_UPSTREAM = "http://127.0.0.1:9"
# mitmdump options this command sets from its own flags: given with --set too, they would disagree.
OWN_OPTIONS = {
    "polar_out": "--out",
    "polar_backend": "--engine",
    "confdir": "--confdir",
    "listen_host": "--host",
    "listen_port": "--port",
    "mode": "--port and --base-url-port",
}
# Defaults a --set of the same name replaces: no dial to the real provider when a tunnel opens (the addon sets it
# too with passthrough blocked), warnings (the exposure one among them) but no per-flow lines (readiness polls).
DEFAULT_OPTIONS = {"connection_strategy": "lazy", "termlog_verbosity": "warn", "flow_detail": "0"}
# Which SDKs read which variable in base-URL mode, and the API behind it (its base-URL suffix: codecs/).
BASE_URL_VARIABLES = (
    ("OPENAI_BASE_URL", "openai_chat"),
    ("ANTHROPIC_BASE_URL", "anthropic"),
    ("GOOGLE_GEMINI_BASE_URL", "google"),
)
CA_FILE = "mitmproxy-ca-cert.pem"
BUNDLE_FILE = "ca-bundle.pem"
READY_SECONDS = 120.0


@dataclass(frozen=True)
class Listeners:
    """Where the gateway listens (`host`, as mitmproxy binds it) and how a client on this machine reaches it."""

    host: str
    proxy_port: int
    reverse_port: int

    @property
    def reach_host(self) -> str:
        """The address to connect to: loopback for a wildcard bind, brackets around an IPv6 address."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::", "[::]") else self.host
        return f"[{host}]" if ":" in host and not host.startswith("[") else host

    @property
    def proxy_url(self) -> str:
        return f"http://{self.reach_host}:{self.proxy_port}"

    @property
    def reverse_url(self) -> str:
        return f"http://{self.reach_host}:{self.reverse_port}"


def parse_set_options(values: list[str]) -> list[tuple[str, str | None]]:
    """`--set NAME=VALUE` (or a bare `NAME`, mitmproxy's true) as pairs, in order: a name set twice stays twice,
    so the addon refuses it as it would on mitmdump's own command line. UserInputError for one of ours."""
    pairs: list[tuple[str, str | None]] = []
    for item in values:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not name:
            raise UserInputError(f"--set {item!r}: expected NAME=VALUE (e.g. polar_max_tokens=4096)")
        if name in OWN_OPTIONS:
            raise UserInputError(f"--set {name}: use {OWN_OPTIONS[name]} instead")
        pairs.append((name, value if sep else None))
    return pairs


def check_polar_options(out: Path, options: list[tuple[str, str | None]]) -> None:
    """The `polar_` options parsed as the addon will parse them — mitmproxy's own parser, then `parse_options` —
    before an engine starts for them: a misspelt name or a bad value is one line at once (UserInputError, or the
    OptionError naming the option), not after the engine has loaded. Other mitmproxy options are mitmdump's."""
    from mitmproxy import optmanager
    from mitmproxy.exceptions import OptionsError

    from polar_mitm.gateway import options as gateway_options

    manager = optmanager.OptManager()
    for option in gateway_options.mitmproxy_options():
        choices = list(option.choices) if option.choices else None
        manager.add_option(option.name, option.typespec, option.default, option.help, choices=choices)
    ours = [(name, value) for name, value in options if name.replace("-", "_").lower().startswith("polar_")]
    for name, _ in ours:
        if name not in manager:
            likely = difflib.get_close_matches(name.replace("-", "_").lower(), list(manager.keys()), n=1)
            hint = f"; did you mean {likely[0]}?" if likely else " (README: gateway options)"
            raise UserInputError(f"--set {name}: no such gateway option{hint}")
        if (times := sum(given == name for given, _ in ours)) > 1:
            raise UserInputError(f"--set {name} is given {times} times; give it once")
    for name, value in [*ours, ("polar_out", str(out))]:
        try:
            manager.set(name if value is None else f"{name}={value}")
        except OptionsError as exc:
            flag = "--out" if name == "polar_out" else f"--set {name}"
            raise UserInputError(f"{flag}: {exc}") from None
    gateway_options.parse_options(manager)  # OptionError names the option


def mitmdump_command(
    backend: str, out: Path, confdir: Path, listeners: Listeners, options: list[tuple[str, str | None]]
) -> list[str]:
    """mitmdump (on uvloop: `gateway/launch.py`) with the polar addon, both listeners, our options, then `options`."""
    given = {name for name, _ in options}
    settings = [
        f"listen_host={listeners.host}",
        f"confdir={confdir}",
        f"polar_backend={backend}",
        f"polar_out={out}",
        *(f"{name}={value}" for name, value in DEFAULT_OPTIONS.items() if name not in given),
        *(name if value is None else f"{name}={value}" for name, value in options),
    ]
    cmd = [
        sys.executable,
        "-m",
        "polar_mitm.gateway.launch",
        "-s",
        str(addon_path()),
        "--mode",
        f"regular@{listeners.proxy_port}",
        *base_url_listener(listeners.reverse_port, DEAD_UPSTREAM, given),
    ]
    for setting in settings:
        cmd += ["--set", setting]
    return cmd


def proxy_mode_env(listeners: Listeners, bundle: Path) -> dict[str, str]:
    """What a harness preset sets in proxy mode (`harness/base.py` `network_env`), for every runtime at once."""
    env = dict.fromkeys(PROXY_VARS, listeners.proxy_url)
    env["NO_PROXY"] = env["no_proxy"] = ""  # a NO_PROXY of the caller's would let calls past the gateway
    for runtime in get_args(Runtime):
        env.update(ca_env(runtime, bundle))
    return env


def base_url_env(listeners: Listeners) -> dict[str, str]:
    """Each SDK's base URL at the reverse listener; NO_PROXY keeps a caller's proxy off the way to it."""
    env = {variable: sdk_base_url(api, listeners.reverse_url) for variable, api in BASE_URL_VARIABLES}
    hosts = dict.fromkeys([listeners.reach_host.strip("[]"), "127.0.0.1", "localhost"])
    env["NO_PROXY"] = env["no_proxy"] = ",".join(hosts)
    return env


def assignments(env: dict[str, str]) -> str:
    """`K=V K=V …`, each value shell-quoted: a prefix to paste before the harness's command."""
    return " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())


def hookup_text(listeners: Listeners, confdir: Path, bundle: Path) -> str:
    """The two ways to point a harness at the gateway, with the exact variables of each."""
    user = f"http://SESSION:x@{listeners.reach_host}:{listeners.proxy_port}"
    preset = (
        f"polar-mitm harness env NAME --session S --gateway-proxy {listeners.proxy_url} "
        f"--gateway-url {listeners.reverse_url} --confdir {shlex.quote(str(confdir))}"
    )
    return "\n".join(
        [
            "",
            "proxy mode (the harness keeps its provider's host; a session id rides in the proxy user name, "
            f"{user}, TASK%2FSESSION with a task):",
            f"  {assignments(proxy_mode_env(listeners, bundle))}",
            "",
            "base-URL mode (a session id rides in the path: …/t/TASK/s/SESSION before /v1):",
            f"  {assignments(base_url_env(listeners))}",
            "",
            f"a harness preset, with its HOME and config: {preset}",
            "Ctrl-C stops it (calls in flight finish first; a second Ctrl-C kills it).",
        ]
    )


@contextmanager
def engine_for_gateway(engine: str | None, model: str) -> Iterator[tuple[str, dict[str, str], str]]:
    """(the gateway's backend, the options it needs, a line saying which engine) for the duration of a block: the
    given engine (SGLang's router, or one started for a comma list), else the embedded one, started and stopped.
    An engine set that cannot be used, or an embedded engine that does not come up, is one line (UserInputError)."""
    with ExitStack() as stack:
        if engine is not None:
            try:
                engines = stack.enter_context(router.attached(engine))
                backend = router.gateway_backends(engines.url, 1)[0]
                needed = router.gateway_options(engines.url)
            except router.EngineSetError as exc:
                raise UserInputError(f"--engine {engine}: {exc}") from None
            yield backend, needed, f"engine {backend}"
            return
        fd, log_name = tempfile.mkstemp(prefix="polar-engine-", suffix=".log")
        os.close(fd)
        print(f"starting the embedded engine ({model}; log {log_name}) …", file=sys.stderr, flush=True)
        try:
            url = stack.enter_context(engine_processes.engine_running(None, model=model, log=Path(log_name)))
        except (RuntimeError, TimeoutError) as exc:
            raise UserInputError(
                f"the embedded engine ({model}) did not start: {exc}; see {log_name}"
            ) from None
        yield url, {}, f"embedded engine {url} (polar-mitm serve --model {model}; log {log_name})"


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGINT/SIGTERM while the engine starts: SystemExit(128 + signal), so every started child is stopped on the
    way out (the embedded engine would outlive a default SIGTERM); `SignalRelay` takes over once mitmdump runs."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class SignalRelay:
    """SIGINT/SIGTERM of this process → SIGTERM to mitmdump once (a clean stop), SIGKILL on the next."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.received = proc, 0
        self._previous = {sig: signal.signal(sig, self._relay) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _relay(self, signum: int, frame: object) -> None:
        self.received += 1
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM if self.received == 1 else signal.SIGKILL)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def wait_listening(listeners: Listeners, proc: subprocess.Popen, timeout: float = READY_SECONDS) -> None:
    """Both ports accept connections (for a gateway writing a flow file, where readiness polls would be saved)."""
    deadline = time.monotonic() + timeout
    for port in (listeners.proxy_port, listeners.reverse_port):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {proc.returncode} before it was ready")
            try:
                socket.create_connection((listeners.reach_host.strip("[]"), port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"port {port} did not open in {timeout:.0f}s") from None
                time.sleep(0.05)


def wait_for_ca(confdir: Path, proc: subprocess.Popen, timeout: float = 30.0) -> Path:
    """mitmproxy's CA certificate, which it writes into its confdir when it starts."""
    ca_cert = confdir / CA_FILE
    deadline = time.monotonic() + timeout
    while not ca_cert.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"mitmproxy wrote no CA at {ca_cert}")
        time.sleep(0.05)
    return ca_cert


def run_gateway(
    backend: str,
    *,
    out: Path,
    confdir: Path,
    listeners: Listeners,
    options: list[tuple[str, str | None]],
    engine_line: str,
) -> int:
    """mitmdump in front of `backend` until it exits (a signal of ours stops it); its exit code."""
    cmd = mitmdump_command(backend, out, confdir, listeners, options)
    env = {k: v for k, v in os.environ.items() if k != engine_keys.KEY_ENV}  # the pipe's key, not a variable
    handover = secret_handover.Handover({engine_keys.HANDOVER_NAME: engine_keys.key_for(backend)})
    try:
        proc = subprocess.Popen(
            cmd,
            start_new_session=True,  # a terminal's Ctrl-C reaches it through SignalRelay only
            preexec_fn=children.die_with_parent,
            **handover.popen_kwargs(env),
        )
    finally:
        handover.close()
    relay = SignalRelay(proc)
    try:
        try:
            if any(name == "save_stream_file" for name, _ in options):
                wait_listening(listeners, proc)
            else:
                wait_gateway_ready(listeners.reverse_url, timeout=READY_SECONDS, proc=proc)
            bundle = write_ca_bundle(wait_for_ca(confdir, proc), confdir / BUNDLE_FILE)
        except (RuntimeError, TimeoutError) as exc:
            if proc.poll() is None:  # not ready in time, or no CA: ours to say and stop
                print(f"polar-mitm gateway: {exc}", file=sys.stderr, flush=True)
                children.stop(proc, timeout=30)
                return 1
            return (
                proc.wait()
            )  # it said why on our stderr (a refused option, a port in use), or a signal stopped it
        print(f"polar-mitm gateway: {engine_line}, records → {out}", flush=True)
        print(hookup_text(listeners, confdir, bundle), flush=True)
        return proc.wait()
    finally:
        if proc.poll() is None:  # an exception of ours: the gateway must not outlive the command
            children.stop(proc, timeout=30)
        relay.restore()


def gateway_command(
    engine: Annotated[
        str | None, typer.Option(help="Engine URL (default: start the embedded engine).")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Embedded engine's model (default tiny).")
    ] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Records folder.")] = Path("flows"),
    host: Annotated[str, typer.Option(help="Listen address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTPS_PROXY port.")] = 8080,
    base_url_port: Annotated[int | None, typer.Option(help="Base-URL port (default --port + 1).")] = None,
    confdir: Annotated[Path, typer.Option(help="mitmproxy confdir (its CA).")] = Path("~/.mitmproxy"),
    set_options: Annotated[
        list[str] | None,
        typer.Option("--set", metavar="NAME=VALUE", help="mitmdump option (repeatable)."),
    ] = None,
) -> None:
    """Run the gateway in the foreground and print how to point a harness at it.

    Without --engine it starts the embedded engine (polar-mitm serve) and stops
    it at the end. Ctrl-C or SIGTERM stops mitmdump cleanly (calls in flight
    finish, the journal is compacted); its exit code is this command's.
    """
    options = parse_set_options(set_options or [])
    if engine is not None and model is not None:
        raise UserInputError("--model picks the embedded engine's model; an --engine serves its own")
    listeners = Listeners(host, port, base_url_port or port + 1)
    for flag, value in (("--port", listeners.proxy_port), ("--base-url-port", listeners.reverse_port)):
        if not 1 <= value <= 65535:
            raise UserInputError(f"{flag} {value}: a port is 1 to 65535")
    if listeners.reverse_port == listeners.proxy_port:
        raise UserInputError(f"--base-url-port {listeners.reverse_port}: the same as --port; pick another")
    check_polar_options(out, options)
    if engine is not None:  # before anything starts: every call would fail
        router.check_answering(engine)
    confdir = confdir.expanduser()
    with stopped_by_signals(), engine_for_gateway(engine, model or "tiny") as (backend, needed, engine_line):
        # Options the engine set needs (behind a router: the tokenizer) come first; a --set of the same wins.
        given = {name for name, _ in options}
        extra = [(name, value) for name, value in needed.items() if name not in given]
        code = run_gateway(
            backend,
            out=out,
            confdir=confdir,
            listeners=listeners,
            options=[*extra, *options],
            engine_line=engine_line,
        )
    raise typer.Exit(code)
