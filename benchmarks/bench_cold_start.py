"""Gateway cold start: seconds from `mitmdump` being started to its first answered model call.

Every test, every rollout and every loop iteration starts a gateway, so what a fresh one costs before it answers
is paid again and again. One engine (`polar-mitm serve --model tiny`) stays up; for each prompt mode a fresh
gateway is started `--starts` times, and the clock runs from `Popen` to

  listening: both listeners accept connections (what `gateway_processes.start_gateway` used to wait for);
  ready:     the gateway's readiness answer says its hot path is loaded (`/_polar/ready`; absent before it existed);
  answered:  a first non-streamed OpenAI chat call, sent as soon as the listener accepts it, has its answer.

messages mode needs no tokenizer: its figure is the floor (mitmproxy's own start). Calls alternate between the
modes so a busy machine's drift hits both alike.

    .venv/bin/python benchmarks/bench_cold_start.py [--starts 3]

Measured 2026-12-01 on the shared 2-core machine at load 7–9 (medians of 2 starts, seconds; the load varies a lot
between runs, so compare rows of one run). Before (transformers' AutoTokenizer loaded on the first call): tokens
mode answered first after 15.1 (messages 5.7), in a later run 9.8 (messages 4.7). After (tiktoken/jinja2 renderer
loaded while starting, start_gateway waiting on readiness): 3.5 [2.4–4.6] (messages 1.8) and 5.9 (messages 3.5).
What is left over messages mode is reading Qwen's 151k-token tokenizer.json and building its ranks (~1.3–2.3 s).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines import processes as engine_processes
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import children, ports, secret_handover
from polar_mitm.session_ids import SessionId

READY_PATH = "/_polar/ready"


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def first_call(base_url: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    response = httpx.post(f"{base_url}/chat/completions", json=body, timeout=120)
    if response.is_error:
        raise RuntimeError(f"the first call: HTTP {response.status_code}: {response.text[:300]}")


def wait_until(check, proc: subprocess.Popen, timeout: float = 120.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}")
        try:
            if check():
                return time.perf_counter()
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise TimeoutError("the gateway did not come up")


def one_start(engine_url: str, root: Path, mode: str) -> dict[str, float]:
    """Start a gateway in `mode`, time listening / ready / first answer, stop it."""
    port = ports.free_port()
    cmd = [
        sys.executable,
        "-m",
        "polar_mitm.gateway.launch",  # as gateway_processes.start_gateway starts it (mitmdump on uvloop)
        "-q",
        "-s",
        str(gateway_processes.addon_path()),
        *gateway_processes.base_url_listener(
            port, "http://127.0.0.1:9", ()
        ),  # as polar-mitm serves base URLs
        "--set",
        f"confdir={root / 'conf'}",
        "--set",
        f"polar_backend={engine_url}",
        "--set",
        f"polar_out={root / 'flows'}",
        "--set",
        f"polar_prompt_mode={mode}",
    ]
    started = time.perf_counter()
    log = open(root / "gateway.log", "ab")  # noqa: SIM115 - closed after the process stops
    # The engine's API key reaches the gateway as `start_gateway` hands it over (an inherited pipe).
    secrets_ = {"control_token": secrets.token_urlsafe(24), "engine_key": engine_keys.key_for(engine_url)}
    handover = secret_handover.Handover({**secrets_, "session_key": None})
    try:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, **handover.popen_kwargs(dict(os.environ))
        )
    finally:
        handover.close()
    base = f"http://127.0.0.1:{port}"
    try:
        listening = wait_until(lambda: port_open(port), proc)
        ready = wait_until(lambda: httpx.get(base + READY_PATH, timeout=2).status_code != 503, proc)
        first_call(SessionId(f"cold-{uuid.uuid4().hex[:8]}").base_url(base, "/v1"))
        answered = time.perf_counter()
    finally:
        children.stop(proc)
        log.close()
    return {"listening": listening - started, "ready": ready - started, "answered": answered - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=3)
    args = parser.parse_args()
    modes = ("tokens", "messages")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with (
        tempfile.TemporaryDirectory() as tmp,
        engine_processes.engine_running(model="tiny", log=Path(tmp) / "engine.log") as url,
    ):
        for start in range(args.starts):
            for mode in modes:
                root = Path(tmp) / f"{mode}-{start}"
                root.mkdir()
                results[mode].append(one_start(url, root, mode))
    print(f"gateway cold start, {args.starts} starts per mode (median [min–max] seconds from Popen)")
    print(f"{'mode':>9} {'listening':>18} {'ready':>18} {'first answer':>18}")
    for mode in modes:
        cells = []
        for key in ("listening", "ready", "answered"):
            values = [r[key] for r in results[mode]]
            cells.append(f"{statistics.median(values):5.2f} [{min(values):.2f}–{max(values):.2f}]")
        print(f"{mode:>9} " + " ".join(f"{cell:>18}" for cell in cells))


if __name__ == "__main__":
    main()
