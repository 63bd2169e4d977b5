"""`polar-mitm doctor`: what this machine has for polar-mitm, and the command that fixes what it lacks.

One line per check, `ok` / `warning` / `missing` (with the fix) / `info`. The checks are a registry (`CHECKS`, in
the order they print): each is a function of the command's options that yields its findings, so a new
prerequisite is one more function here. They ask the code that uses the thing, never a copy of its rules: a
harness is found by its own preset (`Harness.executable`, whose message names its setup script), vLLM by
`vllm.server.vllm_installed`, an engine by `router.check_answering` (as `rollout` and `loop` do before they start).

Only what every capture needs is *required* — Python, mitmdump with the addon, and the engine when `--engine`
names one; the exit code is 1 when one of those is missing, else 0. The rest (Node for the npm harnesses, each
harness, vLLM, bubblewrap, a GPU) is what some commands need, reported so, never failing the run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import typer

Status = Literal["ok", "warning", "missing", "info"]
MIN_PYTHON = (3, 11)  # pyproject.toml's requires-python
MIN_NODE = 20  # what the npm harnesses are run with here (README: Python 3.11, Node 20)
NODE_FIX = "install Node 20+ with npm (e.g. apt-get install nodejs npm), then bash scripts/setup.sh"
SETUP = "bash scripts/setup.sh"
USERNS_PROBE = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"]
PROBE_SECONDS = 20.0


@dataclass(frozen=True)
class Finding:
    """One line of the report."""

    name: str
    status: Status
    detail: str
    fix: str | None = None  # the command (or step) that fixes it
    required: bool = False  # missing → exit code 1

    @property
    def fails(self) -> bool:
        return self.required and self.status == "missing"

    def line(self) -> str:
        fix = f" → fix: {self.fix}" if self.fix else ""
        optional = " (optional)" if self.status == "missing" and not self.required else ""
        return f"{self.status:<8} {self.name:<24} {self.detail}{optional}{fix}"


@dataclass(frozen=True)
class Asked:
    """What the command was asked to check beyond the machine itself."""

    engine: str | None
    confdir: Path


Check = Callable[[Asked], Iterable[Finding]]
CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    """Register a check; they run (and print) in the order they are defined."""
    CHECKS.append(fn)
    return fn


def run_checks(asked: Asked, checks: Iterable[Check] = CHECKS) -> Iterator[Finding]:
    for one in checks:
        yield from one(asked)


def _version_of(command: list[str]) -> str | None:
    """The first line a `--version` command prints, None when it cannot run."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


# -- checks, in the order they print ----------------------------------------------------------------------------


@check
def python(asked: Asked) -> Iterator[Finding]:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] >= MIN_PYTHON:
        yield Finding("python", "ok", f"{version} ({sys.executable})", required=True)
    else:
        want = ".".join(map(str, MIN_PYTHON))
        yield Finding(
            "python",
            "missing",
            f"{version}: polar-mitm needs ≥ {want}",
            f"POLAR_PYTHON=python{want} {SETUP}",
            True,
        )


@check
def node(asked: Asked) -> Iterator[Finding]:
    for name in ("node", "npm"):
        path = shutil.which(name)
        version = _version_of([path, "--version"]) if path else None
        if version is None:
            yield Finding(name, "missing", f"no {name} on PATH: the npm harnesses need it", NODE_FIX)
            continue
        major = int(m.group(1)) if name == "node" and (m := re.match(r"v?(\d+)", version)) else None
        if major is not None and major < MIN_NODE:
            yield Finding(
                name, "warning", f"{version} ({path}): the npm harnesses want ≥ {MIN_NODE}", NODE_FIX
            )
        else:
            yield Finding(name, "ok", f"{version} ({path})")


def _setup_command(message: str) -> str | None:
    """The setup script a preset's not-installed message names, as a command."""
    found = re.search(r"run (scripts/[\w.-]+\.sh)", message)
    return f"bash {found.group(1)}" if found else None


@check
def harnesses(asked: Asked) -> Iterator[Finding]:
    from polar_mitm.harness import HARNESSES, HarnessError

    for harness in HARNESSES.values():
        name = f"harness {harness.name}"
        try:
            path = harness.executable()
        except HarnessError as exc:
            yield Finding(name, "missing", str(exc), _setup_command(str(exc)))
            continue
        version = harness.installed_version()
        yield Finding(name, "ok", f"{harness.package} {version or '(version unknown)'} ({path})")


@check
def mitmdump(asked: Asked) -> Iterator[Finding]:
    from polar_mitm.gateway.processes import addon_path

    fix = f"{SETUP} (or pip install 'polar-mitm[capture]')"
    try:
        version = importlib.metadata.version("mitmproxy")
    except importlib.metadata.PackageNotFoundError:
        yield Finding("mitmdump", "missing", f"mitmproxy is not installed in {sys.executable}", fix, True)
        return
    script = Path(sys.executable).with_name("mitmdump")
    path = str(script) if script.exists() else shutil.which("mitmdump")
    if path is None:
        yield Finding("mitmdump", "missing", f"mitmproxy {version}, but no mitmdump script", fix, True)
    elif not addon_path().exists():
        yield Finding(
            "mitmdump", "missing", f"mitmproxy {version}; the addon {addon_path()} is gone", fix, True
        )
    else:
        yield Finding("mitmdump", "ok", f"mitmproxy {version} ({path}), addon {addon_path()}", required=True)


@check
def mitmproxy_ca(asked: Asked) -> Iterator[Finding]:
    ca_cert = asked.confdir.expanduser() / "mitmproxy-ca-cert.pem"
    if not ca_cert.exists():
        yield Finding(
            "mitmproxy CA",
            "warning",
            f"none yet at {ca_cert}: mitmproxy makes it at its first start (proxy mode needs it)",
            f"polar-mitm gateway --confdir {asked.confdir}",
        )
        return
    try:
        from cryptography import x509

        not_after = x509.load_pem_x509_certificate(ca_cert.read_bytes()).not_valid_after_utc
    except (ImportError, ValueError, OSError) as exc:
        yield Finding("mitmproxy CA", "warning", f"{ca_cert} cannot be read as a certificate ({exc})")
        return
    if not_after < datetime.now(UTC):
        yield Finding(
            "mitmproxy CA",
            "warning",
            f"{ca_cert} expired on {not_after:%Y-%m-%d}",
            f"move {asked.confdir}/mitmproxy-ca* away; the next start makes a new one",
        )
    else:
        yield Finding("mitmproxy CA", "ok", f"{ca_cert} (valid until {not_after:%Y-%m-%d})")


@check
def engine(asked: Asked) -> Iterator[Finding]:
    if asked.engine is None:
        yield Finding(
            "engine",
            "info",
            "not checked (--engine URL checks one; without one, commands start the embedded one)",
        )
        return
    from polar_mitm.engines import router
    from polar_mitm.engines.keys import KeyFileError

    try:
        router.check_answering(asked.engine, embedded=False)
    except (router.EngineUnreachable, KeyFileError) as exc:
        port = urlsplit(asked.engine.split(",")[0]).port or 30000
        fix = f"start one: polar-mitm serve --port {port} (or SGLang, vLLM: recipes/)"
        yield Finding("engine", "missing", str(exc), fix, True)
        return
    try:
        info = router.model_info(asked.engine)
        about = f": {info.get('model_path') or info.get('served_model_name') or 'model ?'}"
        about += f", weight version {info['weight_version']}" if "weight_version" in info else ""
    except (router.EngineSetError, ValueError, KeyFileError):
        about = " (its /model_info did not answer)"
    yield Finding("engine", "ok", f"{asked.engine} answers{about}", required=True)


@check
def vllm(asked: Asked) -> Iterator[Finding]:
    from polar_mitm.vllm.server import VllmNotInstalled, vllm_installed, vllm_python

    try:
        python = vllm_python()
    except VllmNotInstalled as exc:
        yield Finding("vllm", "missing", str(exc).split(":")[0], "bash scripts/setup-vllm.sh")
        return
    if vllm_installed():
        yield Finding("vllm", "ok", f"{python} (polar-mitm vllm serve)")
    else:
        yield Finding(
            "vllm", "warning", f"{python} exists, but its setup did not finish", "bash scripts/setup-vllm.sh"
        )


@check
def bubblewrap(asked: Asked) -> Iterator[Finding]:
    path = shutil.which("bwrap")
    version = _version_of([path, "--version"]) if path else None
    if version is None:
        yield Finding(
            "bwrap",
            "missing",
            "bubblewrap is not installed (session sandboxes)",
            "bash scripts/setup-sandbox.sh",
        )
    else:
        yield Finding("bwrap", "ok", f"{version} ({path})")
    if shutil.which("socat") is None:  # the sandbox's tunnel to its gateway (sandbox/tunnel.py)
        yield Finding(
            "socat", "missing", "socat is not installed (session sandboxes)", "bash scripts/setup-sandbox.sh"
        )
    yield _user_namespace(path)


def _user_namespace(bwrap: str | None) -> Finding:
    """Can a sandbox be made: bwrap's own probe, else (bwrap missing) util-linux's `unshare` for the namespace."""
    name, as_root = "user namespace", " (as root)" if _is_root() else ""
    probe = [bwrap, *USERNS_PROBE[1:]] if bwrap else None
    how = " ".join(USERNS_PROBE)
    if probe is None and (unshare := shutil.which("unshare")):
        probe, how = [unshare, "--user", "--map-root-user", "true"], "unshare --user --map-root-user true"
    if probe is None:
        return Finding(
            name, "warning", "not tried: neither bwrap nor unshare is installed", "apt-get install bubblewrap"
        )
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=PROBE_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Finding(name, "warning", f"`{how}` did not run ({exc})")
    if done.returncode == 0:
        return Finding(name, "ok", f"`{how}` works{as_root}")
    said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    return Finding(
        name,
        "warning",
        f"`{how}` failed{as_root}: {said}",
        "sysctl -w kernel.unprivileged_userns_clone=1 (Debian) or kernel.apparmor_restrict_unprivileged_userns=0",
    )


def _is_root() -> bool:
    return os.geteuid() == 0


@check
def gpu(asked: Asked) -> Iterator[Finding]:
    if importlib.util.find_spec("torch") is None:
        yield Finding("gpu", "info", "torch is not installed here (the serve/train extras install it)")
        return
    import torch

    if not torch.cuda.is_available():
        yield Finding(
            "gpu", "info", f"none (torch {torch.__version__}: CPU; the embedded engine and vLLM's CPU build)"
        )
        return
    names = [torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count())]
    yield Finding(
        "gpu", "info", f"{len(names)} × {', '.join(sorted(set(names)))} (torch {torch.__version__})"
    )


# -- the command ------------------------------------------------------------------------------------------------


def doctor_command(
    engine: Annotated[str | None, typer.Option(help="Also check the engine at this URL.")] = None,
    confdir: Annotated[Path, typer.Option(help="mitmproxy confdir (its CA).")] = Path("~/.mitmproxy"),
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Check this machine for polar-mitm, one line per check, with what fixes it."""
    findings = list(run_checks(Asked(engine, confdir)))
    failing = [f.name for f in findings if f.fails]
    if as_json:
        report = {"ok": not failing, "checks": [asdict(f) for f in findings]}
        typer.echo(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        for finding in findings:
            typer.echo(finding.line())
        optional = sum(f.status == "missing" and not f.required for f in findings)
        if failing:
            typer.echo(f"missing what every capture needs: {', '.join(failing)}")
        else:
            typer.echo(f"ready: nothing required is missing ({optional} optional missing)")
    raise typer.Exit(1 if failing else 0)
