"""The gateway's added latency on vLLM versus on the embedded engine: same checkpoint, same calls, same run.

Both engines serve the tiny model at head_dim 32 (the one vLLM's CPU attention accepts). For each engine, the same
OpenAI Chat call (a ~1k-token prompt, 8 sampled tokens at T=1) is made directly against the engine and through
the gateway (mitmdump + addon, reverse mode, tokens mode, fsynced records): a fresh session per call (a chain's
first call, the engine renders) and a session's second turn (token-in: on vLLM `/v1/completions`). Prints the
median of each and the gateway's added latency (gateway − direct).
Run: .venv/bin/python benchmarks/bench_vllm_gateway.py [--calls 20]   (needs bash scripts/setup-vllm.sh)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

from polar_mitm import procs
from polar_mitm.session_ids import SessionId
from polar_mitm.vllm.server import resolve_vllm_model, vllm_running

PROMPT = "Summarise this: " + "word " * 1000
SAMPLING = {"max_tokens": 8, "temperature": 1.0}


def median_ms(call: Callable[[], None], calls: int) -> float:
    call()  # warm: connections, the gateway's renderer, the engine's first batch
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def post(url: str, body: dict) -> dict:
    response = httpx.post(url, json=body, timeout=300)
    response.raise_for_status()
    return response.json()


def measure(engine_url: str, served: str, root: Path, calls: int) -> dict[str, float]:
    """Median ms of: direct, gateway (first call of a session), gateway (second turn, token-in)."""
    first_turn = [{"role": "user", "content": PROMPT}]
    direct = median_ms(
        lambda: post(
            f"{engine_url}/v1/chat/completions", {"model": served, "messages": first_turn, **SAMPLING}
        ),
        calls,
    )
    with procs.gateway_running(engine_url, root / "flows", confdir=root / "conf") as gateway:

        def session_base() -> str:
            return f"{gateway.reverse_url}{SessionId(uuid.uuid4().hex[:12], 'bench').path_prefix}/v1"

        def first() -> None:
            post(f"{session_base()}/chat/completions", {"model": "m", "messages": first_turn, **SAMPLING})

        def second() -> None:
            base = session_base()
            answer = post(f"{base}/chat/completions", {"model": "m", "messages": first_turn, **SAMPLING})
            text = answer["choices"][0]["message"]["content"] or ""
            turn_two = [
                *first_turn,
                {"role": "assistant", "content": text},
                {"role": "user", "content": "More."},
            ]
            started = time.perf_counter()
            post(f"{base}/chat/completions", {"model": "m", "messages": turn_two, **SAMPLING})
            second_times.append((time.perf_counter() - started) * 1000)

        second_times: list[float] = []
        via_gateway = median_ms(first, calls)
        for _ in range(calls):
            second()
    return {"direct": direct, "gateway": via_gateway, "gateway_turn2": statistics.median(second_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    model_dir = resolve_vllm_model("tiny")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with procs.engine_running(model=str(model_dir), log=root / "embedded.log") as url:
            results["embedded"] = measure(url, "tiny", root / "embedded", args.calls)
        with vllm_running(model_dir, log=root / "vllm.log") as url:
            served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            results["vllm"] = measure(url, served, root / "vllm", args.calls)
    print("| engine | direct p50 | gateway p50 (new session) | added | gateway p50 (turn 2, token-in) |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        added = r["gateway"] - r["direct"]
        print(
            f"| {name} | {r['direct']:.1f} ms | {r['gateway']:.1f} ms | {added:+.1f} ms | {r['gateway_turn2']:.1f} ms |"
        )


if __name__ == "__main__":
    main()
