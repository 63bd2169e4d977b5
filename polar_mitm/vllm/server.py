"""Start vLLM on a model directory with the flags the gateway and the trainer rely on, from the project's venv.

The flags that matter for RL, on every device: `--logprobs-mode processed_logprobs` (the recorded logprob is the
sampling distribution's, after temperature — vLLM's default `raw_logprobs` ignores the temperature), the worker
extension for weight reloads that keep a tied head right (worker_extension.py), the dev-mode endpoints for weight
pushes, versions and aborts by request id (`VLLM_SERVER_DEV_MODE=1`), the model family's tool-call parser (named
to the gateway through `--additional-config`: the gateway parses the answers itself), no reasoning parser (`<think>`
text comes back as text and the gateway splits it with the embedded engine's parser, so the three engines' answers
are split alike), the model's generation_config ignored (the gateway sends every sampling field itself), and the
scale-out endpoints on (the gateway's calls go to `/inference/v1/generate`, whose answers say which weight version
sampled which tokens; engines/dialects/vllm.py). On CPU
also what was measured to work here: fp32 (bf16 was ~3× slower), `--enforce-eager`, a 1 GiB KV cache. vLLM runs
in its own venv (scripts/setup-vllm.sh) through `polar_mitm.vllm.launcher`, with this repository on PYTHONPATH so
its processes can import the worker extension. Every route but /health needs the engine's API key: vLLM's own
`--api-key` guards only /v1 (and would be on its command line and in its logged arguments), so our middleware
(`engine_keys.ProcessKeyGuard`) guards them all, the key handed to the launcher through an inherited pipe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import httpx

from polar_mitm.engine.tool_call_formats import DEFAULT_TOOL_CALL_PARSER, tool_call_format
from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines.dialects.vllm import POLAR_TOOL_CALL_PARSER_KEY
from polar_mitm.processes import children, ports, secret_handover
from polar_mitm.vllm import SCRIPT_ENV, SCRIPTED_POLICY

Device = Literal["cpu", "gpu"]
REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = REPO_ROOT / ".venv-vllm"
WORKER_EXTENSION = "polar_mitm.vllm.worker_extension.PolarWorkerExtension"
KEY_GUARD = "polar_mitm.engines.keys.ProcessKeyGuard"  # the key check on every route but /health
STARTUP_SECONDS = 300.0  # measured 45–76 s on a quiet 2-core machine; more while tests share the cores

# Flags for every device.
COMMON_FLAGS = [
    "--logprobs-mode",
    "processed_logprobs",
    "--worker-extension-cls",
    WORKER_EXTENSION,
    "--generation-config",
    "vllm",
    # /inference/v1/generate and the render endpoints: answers that say which tokens each weight version sampled
    "--enable-scale-out",
]
# Our tool-call parser names → vLLM's for the same notation (hermes = the `<tool_call>{json}</tool_call>` one).
VLLM_TOOL_CALL_PARSERS = {"hermes": "hermes", "qwen25": "hermes", "qwen3_coder": "qwen3_coder"}
DEVICE_FLAGS: dict[str, list[str]] = {
    "cpu": ["--dtype", "float32", "--enforce-eager", "--max-model-len", "8192"],
    "gpu": ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.85", "--enable-prefix-caching"],
}


class VllmNotInstalled(RuntimeError):
    """vLLM's venv is missing: `bash scripts/setup-vllm.sh` makes it."""


def vllm_python() -> Path:
    """The Python that runs vLLM: $POLAR_VLLM_PYTHON, else `.venv-vllm/bin/python` (scripts/setup-vllm.sh)."""
    chosen = os.environ.get("POLAR_VLLM_PYTHON")
    python = Path(chosen) if chosen else VENV / "bin" / "python"
    if not python.exists():
        raise VllmNotInstalled(f"no vLLM environment at {python}: run `bash scripts/setup-vllm.sh` first")
    return python


def vllm_installed() -> bool:
    """Has scripts/setup-vllm.sh completed here (its stamp is written last)?"""
    return bool(os.environ.get("POLAR_VLLM_PYTHON")) or (VENV / ".polar-vllm-stamp").exists()


def resolve_vllm_model(spec: str, *, seed: int = 0) -> Path:
    """`tiny` → the tiny model at the head_dim vLLM's CPU attention accepts; anything else as the engine does."""
    if spec == "tiny":
        from polar_mitm.engine.model_zoo import cache_root
        from polar_mitm.engine.tiny_model import VLLM_HEAD_DIM, ensure_tiny_model

        out = cache_root() / "models" / f"tiny-qwen3-hd{VLLM_HEAD_DIM}-seed{seed}"
        return ensure_tiny_model(out, seed=seed, head_dim=VLLM_HEAD_DIM)
    from polar_mitm.engine.model_zoo import resolve_model

    return resolve_model(spec, seed=seed)


def tool_call_flags(tool_call_parser: str) -> list[str]:
    """vLLM's flags for one of our tool-call parser names (`engine/tool_call_formats.py`).

    The gateway parses every answer itself (vLLM gets `tool_choice: "none"`; the token-in path is raw text), so the
    name must reach the gateway: it rides in vLLM's `--additional-config`, which the dev-mode `/server_info` shows
    and the vLLM dialect reads. vLLM's own parser of the same notation is set too (`--enable-auto-tool-choice` is
    what lets requests with tools in), so that a client calling vLLM directly gets the same calls."""
    tool_call_format(tool_call_parser)  # an unknown name: UnknownToolCallParser, one line at start
    said = []  # the default is what the gateway assumes of a vLLM that names none: the command line stays as it was
    if tool_call_parser != DEFAULT_TOOL_CALL_PARSER:
        said = ["--additional-config", json.dumps({POLAR_TOOL_CALL_PARSER_KEY: tool_call_parser})]
    if tool_call_parser == "none":
        return said
    return [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        VLLM_TOOL_CALL_PARSERS[tool_call_parser],
        *said,
    ]


def vllm_command(
    model_dir: Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    device: Device = "cpu",
    served_name: str | None = None,
    scripted_policy: bool = False,
    extra_args: list[str] | None = None,
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER,
) -> list[str]:
    """The launcher's command line for `model_dir` (its Python is vLLM's venv). `scripted_policy` loads the scripted
    test policy (inert until a script is set: at start through $POLAR_VLLM_SCRIPT, or later over /collective_rpc)."""
    return [
        str(vllm_python()),
        "-m",
        "polar_mitm.vllm.launcher",
        "serve",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_name or model_dir.name,
        "--middleware",
        KEY_GUARD,
        *COMMON_FLAGS,
        *tool_call_flags(tool_call_parser),
        *DEVICE_FLAGS[device],
        *(["--logits-processors", SCRIPTED_POLICY] if scripted_policy else []),
        *(extra_args or []),
    ]


def vllm_environment(
    device: Device = "cpu", *, kv_cache_gib: int = 1, script: Path | None = None
) -> dict[str, str]:
    """The environment vLLM runs with: dev-mode endpoints, this repository importable, nothing fetched, and the
    scripted policy's script when given."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /weight_info, /abort_requests, /pause, /server_info
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))  # GiB
        env["VLLM_TARGET_DEVICE"] = "cpu"
    if script is not None:
        env[SCRIPT_ENV] = str(Path(script).resolve())
    return env


def start_vllm(
    model: str | Path,
    *,
    port: int | None = None,
    log: Path | None = None,
    device: Device = "cpu",
    extra_args: list[str] | None = None,
    timeout: float = STARTUP_SECONDS,
    scripted_policy: bool = False,
    script: Path | None = None,
    api_key: str | None = None,
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER,
) -> tuple[subprocess.Popen, str]:
    """vLLM in its own process group; returns (process, base URL) once `/health` answers. `script` plays a scripted
    policy from the start (it implies `scripted_policy`). Its API key (`api_key`, else a new one) is handed over
    through a pipe and remembered for its URL (`engine_keys.key_for`)."""
    model_dir = resolve_vllm_model(str(model)) if not Path(model).is_dir() else Path(model)
    port = port or ports.free_port()
    cmd = vllm_command(
        model_dir,
        port=port,
        device=device,
        scripted_policy=scripted_policy or script is not None,
        extra_args=extra_args,
        tool_call_parser=tool_call_parser,
    )
    out = open(log, "ab") if log else subprocess.DEVNULL
    key = api_key or engine_keys.new_key()
    handover = secret_handover.Handover({engine_keys.HANDOVER_NAME: key})
    env = {k: v for k, v in vllm_environment(device, script=script).items() if k != engine_keys.KEY_ENV}
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # vLLM starts an engine-core process: stopped with the group
            **handover.popen_kwargs(env),
        )
    finally:
        handover.close()
    url = f"http://127.0.0.1:{port}"
    engine_keys.remember(url, key)
    try:
        ports.wait_http(f"{url}/health", timeout=timeout, proc=proc)
    except BaseException:
        stop_vllm(proc)
        raise
    return proc, url


def stop_vllm(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM vLLM's process group, then SIGKILL what is left after `grace` seconds."""
    if proc.poll() is None:
        children.kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    children.kill_group(proc.pid, signal.SIGKILL)  # the engine core, if it outlived the API server
    if proc.poll() is None:
        proc.wait()


@contextmanager
def vllm_running(model: str | Path = "tiny", **kwargs) -> Iterator[str]:
    """vLLM's base URL for the duration of a block (started for it, stopped after)."""
    proc, url = start_vllm(model, **kwargs)
    try:
        yield url
    finally:
        stop_vllm(proc)
        engine_keys.forget(url)


def scripted_policy_call(url: str, method: str, kwargs: dict, *, timeout: float = 60.0) -> None:
    """One of the worker extension's scripted-policy methods on a running vLLM (started with `scripted_policy`)."""
    response = httpx.post(
        f"{url.rstrip('/')}/collective_rpc",
        json={"method": method, "kwargs": kwargs},
        timeout=timeout,
        headers=engine_keys.auth_headers(url),
    )
    response.raise_for_status()


def set_vllm_script(url: str, script: Path | None, *, timeout: float = 60.0) -> None:
    """Make a running vLLM (started with `scripted_policy`) play `script` from its next request; None: sample freely."""
    path = None if script is None else str(script)
    scripted_policy_call(url, "polar_set_script", {"path": path}, timeout=timeout)


@contextmanager
def vllm_paced(url: str, seconds: float, *, timeout: float = 60.0) -> Iterator[None]:
    """A running vLLM (started with `scripted_policy`) rests `seconds` after every step for the duration of a block:
    its calls stream as they are sampled even on a loaded machine, so a test can act in the middle of one."""

    scripted_policy_call(url, "polar_set_pace", {"seconds": seconds}, timeout=timeout)
    try:
        yield
    finally:
        scripted_policy_call(url, "polar_set_pace", {"seconds": 0.0}, timeout=timeout)


@contextmanager
def vllm_playing(url: str, script: Path) -> Iterator[None]:
    """A running vLLM plays `script` for the duration of a block, then samples freely again."""
    set_vllm_script(url, script)
    try:
        yield
    finally:
        set_vllm_script(url, None)


def exec_vllm(
    model: str,
    *,
    port: int,
    host: str,
    device: Device,
    extra_args: list[str],
    script: Path | None = None,
    api_key: str | None = None,
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER,
) -> None:
    """Replace this process with vLLM (the foreground `polar-mitm vllm serve`); `api_key` reaches it through a pipe
    that survives the exec (without one: sampling routes only, no weight pushes)."""
    model_dir = resolve_vllm_model(model) if not Path(model).is_dir() else Path(model)
    cmd = vllm_command(
        model_dir,
        port=port,
        host=host,
        device=device,
        scripted_policy=script is not None,
        extra_args=extra_args,
        tool_call_parser=tool_call_parser,
    )
    env = vllm_environment(device, script=script)
    os.execve(cmd[0], cmd, engine_keys.handover_across_exec(api_key, env) if api_key else env)


__all__ = [
    "VllmNotInstalled",
    "exec_vllm",
    "set_vllm_script",
    "start_vllm",
    "stop_vllm",
    "vllm_installed",
    "vllm_playing",
    "vllm_running",
]
