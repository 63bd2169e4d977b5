"""The gateway's added latency on vLLM versus on the embedded engine: same checkpoint, same calls, same run.

Both engines serve the tiny model at head_dim 32 (the one vLLM's CPU attention accepts). For each engine, the same
OpenAI Chat call (a ~1k-token prompt, 8 sampled tokens at T=1) is made directly against the engine and through
the gateway (mitmdump + addon, reverse mode, tokens mode, fsynced records): a fresh session per call (a chain's
first call, the engine renders) and a session's second turn (token-in: on vLLM `/v1/completions`), interleaved.
Prints the median of each and the gateway's added latency (gateway − direct).
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

from polar_mitm.engines import processes as engine_processes
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.session_ids import SessionId
from polar_mitm.vllm.server import resolve_vllm_model, vllm_running

PROMPT = "Summarise this: " + "word " * 1000
SAMPLING = {"max_tokens": 8, "temperature": 1.0}


def timed_ms(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def post(url: str, body: dict) -> dict:
    response = httpx.post(url, json=body, timeout=300)
    response.raise_for_status()
    return response.json()


def measure(engine_url: str, served: str, root: Path, calls: int) -> dict[str, float]:
    """Median ms of: direct, gateway (first call of a session), gateway (second turn, token-in). The three are
    interleaved call by call, so load from elsewhere on the machine falls on all of them alike."""
    first_turn = [{"role": "user", "content": PROMPT}]
    times: dict[str, list[float]] = {"direct": [], "gateway": [], "gateway_turn2": []}
    with gateway_processes.gateway_running(engine_url, root / "flows", confdir=root / "conf") as gateway:

        def direct() -> None:
            post(f"{engine_url}/v1/chat/completions", {"model": served, "messages": first_turn, **SAMPLING})

        def session_base() -> str:
            return f"{gateway.reverse_url}{SessionId(uuid.uuid4().hex[:12], 'bench').path_prefix}/v1"

        def two_turns() -> tuple[float, float]:
            base = session_base()
            answer: dict = {}
            first = timed_ms(
                lambda: answer.update(
                    post(f"{base}/chat/completions", {"model": "m", "messages": first_turn, **SAMPLING})
                )
            )
            text = answer["choices"][0]["message"]["content"] or ""
            turn_two = [
                *first_turn,
                {"role": "assistant", "content": text},
                {"role": "user", "content": "More."},
            ]
            second = timed_ms(
                lambda: post(f"{base}/chat/completions", {"model": "m", "messages": turn_two, **SAMPLING})
            )
            return first, second

        direct()  # warm: connections, the gateway's renderer, the engine's first batch
        two_turns()
        for _ in range(calls):
            times["direct"].append(timed_ms(direct))
            first, second = two_turns()
            times["gateway"].append(first)
            times["gateway_turn2"].append(second)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    model_dir = resolve_vllm_model("tiny")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with engine_processes.engine_running(model=str(model_dir), log=root / "embedded.log") as url:
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
