"""What every harness preset shares: the hook-up (gateway, session, task, mode) and the isolated environment.

A preset (one module per harness) only says what is particular to its CLI: the config files it reads, the
environment that points it at a provider and keeps it quiet, its runtime (for CA trust), its shell tool and the
command line of a one-shot prompt. `Harness.prepare` turns that into an isolated HOME plus an environment.
"""

from __future__ import annotations

import json
import os
import shutil
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from polar_mitm.session_ids import SessionId

Mode = Literal["proxy", "base-url"]
MODES: tuple[Mode, ...] = ("proxy", "base-url")
Runtime = Literal["bun", "node", "rust", "python"]
ProviderName = Literal["anthropic", "openai_chat", "openai_responses", "google"]  # codecs/ names them so

# Nothing listens on the discard port: in base-URL mode every request that is not for the gateway (telemetry,
# update checks, plugin downloads) is pointed at it through the proxy variables and fails at once, offline.
DEAD_PROXY = "http://127.0.0.1:9"
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
# Inherited from the caller: what a CLI needs to start (its interpreter on PATH, a locale), nothing that could
# point it elsewhere (proxies, API keys, config directories).
INHERITED_VARS = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL", "TERM")
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# Task and session ids name directories and log files (a file name holds 255 bytes; the rollout appends a suffix).
MAX_ID_BYTES = 200
# Control characters (NUL, ESC, newline, DEL, C1), lone surrogates and line/paragraph separators: they cannot be
# passed in argv or environments, break paths and log lines, or drive the terminal that prints the id.
UNSAFE_ID_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})


class HarnessError(RuntimeError):
    """A harness cannot be prepared or found (unknown name, CLI not installed, bad hook-up)."""


def id_problem(value: object, *, allow_slash: bool = False) -> str | None:
    """What makes `value` unusable as a task or session id, or None when it is fine.

    Any other text is allowed (shell syntax included: every consumer quotes it). Not allowed: empty, '/' (a session
    id: TASK/SESSION is split at the last slash; a rollout task id: it names a directory) unless `allow_slash`,
    '.' and '..' (path segments), control and separator characters, more than MAX_ID_BYTES bytes of UTF-8.
    """
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if "/" in value and not allow_slash:
        return "cannot contain '/'"
    if value in (".", ".."):
        return "cannot be '.' or '..'"
    for char in value:
        if unicodedata.category(char) in UNSAFE_ID_CATEGORIES:
            return f"cannot contain control or separator characters (found {char!r})"
    if len(value.encode("utf-8")) > MAX_ID_BYTES:
        return f"is longer than {MAX_ID_BYTES} bytes"
    return None


@dataclass(frozen=True)
class Hookup:
    """Where a harness's model calls go, and which session and task they belong to."""

    mode: Mode
    session: str
    task: str | None = None
    gateway_proxy: str = "http://127.0.0.1:8080"  # the gateway's regular listener (HTTPS_PROXY mode)
    gateway_url: str = "http://127.0.0.1:8081"  # the gateway's reverse listener (base-URL mode)
    ca_bundle: Path | None = None  # system CAs + mitmproxy's CA; required in proxy mode
    credential: str | None = None  # the session credential a rollout's gateway asks for (session_ids.py)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise HarnessError(f"mode must be one of {MODES}, got {self.mode!r}")
        if (problem := id_problem(self.session)) is not None:
            raise HarnessError(f"the session id {problem}: {self.session!r}")
        if self.task and (problem := id_problem(self.task, allow_slash=True)) is not None:
            raise HarnessError(f"the task id {problem}: {self.task!r}")
        if self.mode == "proxy" and self.ca_bundle is None:
            raise HarnessError(
                "proxy mode needs a CA bundle (system CAs + mitmproxy's CA) for the harness to trust"
            )

    @property
    def session_id(self) -> SessionId:
        """The session and task ids, which build every form the gateway reads (polar_mitm/session_ids.py)."""
        return SessionId(self.session, self.task, self.credential)

    @property
    def identity(self) -> str:
        """`TASK/SESSION` or `SESSION`: the form the gateway reads from API keys and proxy user names."""
        return self.session_id.compact

    @property
    def api_key(self) -> str:
        """An API key that also names the session (`polar-TASK/SESSION`), for clients that hide the base URL."""
        return self.session_id.api_key

    @property
    def path_prefix(self) -> str:
        """`/t/TASK/s/SESSION`: the reverse gateway strips it and records the ids."""
        return self.session_id.path_prefix

    def base_url(self, suffix: str = "") -> str:
        """The gateway's reverse URL with the session prefix, plus a provider suffix such as `/v1`."""
        return self.session_id.base_url(self.gateway_url, suffix)

    @property
    def proxy_url(self) -> str:
        """`http://TASK%2FSESSION:x@host:port`: every harness sends this user name on CONNECT."""
        parts = urlsplit(self.gateway_proxy)
        return self.session_id.proxy_url(f"{parts.hostname}:{parts.port}", parts.scheme or "http")


@dataclass(frozen=True)
class ShellTool:
    """The tool a harness's model calls to run a shell command, and how that call's arguments look."""

    name: str
    arguments: dict[str, Any]  # with COMMAND where the command goes

    def call(self, command: str) -> dict[str, Any]:
        return _substitute(self.arguments, command)


COMMAND = "{command}"


def _substitute(value: Any, command: str) -> Any:
    if value == COMMAND:
        return command
    if isinstance(value, dict):
        return {k: _substitute(v, command) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, command) for v in value]
    return value


@dataclass
class Prepared:
    """A harness ready to run: the environment to export and the config files written into its HOME."""

    name: str
    home: Path
    env: dict[str, str]
    files: list[Path]

    def exports(self) -> str:
        """`export K=V` lines, shell-quoted, sorted."""
        import shlex

        return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))


class Harness:
    """One real agent CLI. Subclasses set the class attributes and override the small hooks below."""

    name: ClassVar[str]  # registry key, e.g. "claude-code"
    package: ClassVar[str]  # the npm package pinned in package.json
    binary: ClassVar[str]  # its executable under node_modules/.bin
    runtime: ClassVar[Runtime]  # decides how it is told to trust mitmproxy's CA
    api: ClassVar[ProviderName]  # the provider API it speaks in proxy mode (its recorded flow says the same)
    base_url_api: ClassVar[ProviderName | None] = None  # in base-URL mode, where that differs
    shell_tools: ClassVar[tuple[ShellTool, ...]]  # what its model calls to run a command (first = usual)

    # -- hooks --------------------------------------------------------------------------------------------------

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        """Files to write, by path relative to HOME."""
        return {}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        """Provider selection and credentials (base URL in base-URL mode, API key always)."""
        return {}

    def unattended_env(self) -> dict[str, str]:
        """Telemetry, update checks and plugin downloads off; no questions asked (permissions, trust)."""
        return {}

    def prompt_args(self, prompt: str) -> list[str]:
        """Arguments after the binary for a one-shot, non-interactive prompt that may run tools unattended."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------------------------

    def prepare(self, hookup: Hookup, home: Path) -> Prepared:
        """Write the config files into `home` (created) and return the full environment for the harness."""
        home = home.resolve()
        home.mkdir(parents=True, exist_ok=True)
        written = []
        for relative, text in self.config_files(hookup, home).items():
            path = home / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
        env = {
            **home_env(home),
            **network_env(hookup, self.runtime),
            **self.unattended_env(),
            **self.provider_env(hookup, home),
        }
        return Prepared(name=self.name, home=home, env=env, files=written)

    def executable(self, bin_dir: Path | None = None) -> Path:
        """The installed CLI: `bin_dir` (default: the repo's node_modules/.bin), else PATH."""
        candidate = (bin_dir or REPO_ROOT / "node_modules" / ".bin") / self.binary
        if candidate.exists():
            return candidate
        found = shutil.which(self.binary)
        if found:
            return Path(found)
        raise HarnessError(f"{self.binary} ({self.package}) is not installed: run scripts/setup.sh (npm ci)")

    def installed_version(self) -> str | None:
        """The installed version (from node_modules), None when it is not installed."""
        manifest = REPO_ROOT / "node_modules" / self.package / "package.json"
        return json.loads(manifest.read_text())["version"] if manifest.exists() else None

    def command(self, prompt: str, *, bin_dir: Path | None = None) -> list[str]:
        """The full command line of a one-shot prompt."""
        return [str(self.executable(bin_dir)), *self.prompt_args(prompt)]


def home_env(home: Path) -> dict[str, str]:
    """HOME and the XDG directories inside it, so nothing of the caller's own config is read or written."""
    return {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
    }


def network_env(hookup: Hookup, runtime: Runtime) -> dict[str, str]:
    """Proxy variables and CA trust for the mode.

    Proxy mode sends everything through the gateway (model calls are answered, the rest is blocked there).
    Base-URL mode reaches the gateway directly (NO_PROXY) and sends everything else to a dead port.
    """
    env: dict[str, str] = {}
    if hookup.mode == "proxy":
        env.update(dict.fromkeys(PROXY_VARS, hookup.proxy_url))
        env["NO_PROXY"] = env["no_proxy"] = ""
        env.update(ca_env(runtime, hookup.ca_bundle))
    else:
        gateway_host = urlsplit(hookup.gateway_url).hostname or "127.0.0.1"
        env.update(dict.fromkeys(PROXY_VARS, DEAD_PROXY))
        env["NO_PROXY"] = env["no_proxy"] = ",".join(dict.fromkeys([gateway_host, "127.0.0.1", "localhost"]))
        if hookup.ca_bundle is not None:
            env.update(ca_env(runtime, hookup.ca_bundle))
    return env


def ca_env(runtime: Runtime, bundle: Path | None) -> dict[str, str]:
    """Trust the bundle the way the runtime reads it.

    Node reads only NODE_EXTRA_CA_CERTS (added to its own store); Rust's rustls/native-tls clients (Codex) only
    SSL_CERT_FILE (which replaces the system store, hence a bundle of system CAs + mitmproxy's CA); Bun binaries
    (Claude Code, opencode) take either; Python clients (mini-swe-agent: httpx, requests) SSL_CERT_FILE and
    REQUESTS_CA_BUNDLE.
    """
    if bundle is None:
        return {}
    # Absolute: the harness runs in its workspace, where a relative path (`polar-mitm rollout`'s default work dir
    # is runs/rollout) names nothing, and Hermes, httpx and Node then fail or ignore the bundle.
    path = str(bundle.absolute())
    return {
        "node": {"NODE_EXTRA_CA_CERTS": path},
        "rust": {"SSL_CERT_FILE": path},
        "bun": {"NODE_EXTRA_CA_CERTS": path, "SSL_CERT_FILE": path},
        "python": {"SSL_CERT_FILE": path, "REQUESTS_CA_BUNDLE": path},
    }[runtime]


def base_environment(extra_path: list[Path] | None = None) -> dict[str, str]:
    """A minimal environment to start a harness from (see INHERITED_VARS), with `extra_path` first on PATH."""
    env = {k: os.environ[k] for k in INHERITED_VARS if k in os.environ}
    if extra_path:
        env["PATH"] = os.pathsep.join([*(str(p) for p in extra_path), env.get("PATH", os.defpath)])
    env.setdefault("TERM", "dumb")
    return env


# -- harnesses installed from PyPI into a venv of their own (mini-swe-agent, Aider, Hermes, OpenHands) ---------------


class VenvHarness(Harness):
    """A harness that `setup_script` installs from PyPI into a venv of its own (its pins must not decide ours);
    `venv_variable` names the environment variable that moves the venv."""

    runtime: ClassVar[Runtime] = "python"
    venv: ClassVar[str]  # the venv's folder under the repository root
    venv_variable: ClassVar[str]
    setup_script: ClassVar[str]
    distribution: ClassVar[str]  # its dist-info name, e.g. `aider_chat`

    def venv_dir(self) -> Path:
        return Path(os.environ.get(self.venv_variable) or REPO_ROOT / self.venv)

    def executable(self, bin_dir: Path | None = None) -> Path:
        """`binary` in the harness's own venv, else on PATH (the npm CLIs' folder does not hold it)."""
        candidate = self.venv_dir() / "bin" / self.binary
        if candidate.exists():
            return candidate
        found = shutil.which(self.binary)
        if found:
            return Path(found)
        raise HarnessError(f"{self.binary} ({self.package}) is not installed: run {self.setup_script}")

    def installed_version(self) -> str | None:
        name = self.distribution
        found = sorted(self.venv_dir().glob(f"lib/python*/site-packages/{name}-*.dist-info"))
        return found[-1].name.removeprefix(f"{name}-").removesuffix(".dist-info") if found else None
