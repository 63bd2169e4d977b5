"""Added latency of the polar addon over a bare forwarding mitmdump, to the same engine.

The engine here is a replay server that answers every chat call at once with an SGLang-shaped answer carrying the
prompt's token ids (so payload sizes are real: a 32k-token prompt means 32k ids coming back), which isolates the
gateway's own cost from model time. Both paths go client → mitmdump → engine over loopback:

  bare:  mitmdump --mode reverse:ENGINE           (forwards the OpenAI chat request untouched)
  polar: mitmdump -s addon/polar.py (reverse)     (decode → engine → encode → fsynced record → answer)

Prints p50/p99 per prompt size, for sequential calls and for 64 concurrent sessions, and the added latency.
Run: .venv/bin/python benchmarks/bench_gateway.py [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar_mitm import procs

WORD_TOKENS = 1  # " word" is one token in Qwen's BPE; the replay engine counts words as prompt tokens


def replay_engine(port: int) -> threading.Thread:
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        n_prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", [])) * WORD_TOKENS
        completion = list(range(100, 132))
        answer = {
            "id": "chatcmpl-replay",
            "object": "chat.completion",
            "created": 0,
            "model": "replay",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok " * 16},
                    "finish_reason": "stop",
                    "prompt_token_ids": list(range(n_prompt)),
                    "response_token_ids": completion,
                    "meta_info": {
                        "weight_version": "0",
                        "output_token_logprobs": [[-0.5, t, None] for t in completion],
                    },
                }
            ],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": 32, "total_tokens": n_prompt + 32},
        }
        return Response(orjson.dumps(answer), media_type="application/json")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    procs.wait_port(port)
    return thread


def bare_mitmdump(engine_port: int, port: int, confdir: Path) -> subprocess.Popen:
    mitmdump = Path(sys.executable).with_name("mitmdump")
    proc = subprocess.Popen(
        [
            str(mitmdump),
            "-q",
            "--mode",
            f"reverse:http://127.0.0.1:{engine_port}@{port}",
            "--set",
            f"confdir={confdir}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs.wait_port(port, proc=proc)
    return proc


def body_for(n_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": "gpt",
            "max_tokens": 32,
            "messages": [{"role": "user", "content": " ".join(["word"] * n_tokens)}],
        }
    )


def sequential(url: str, body: bytes, calls: int) -> list[float]:
    times = []
    with httpx.Client(timeout=60, trust_env=False) as client:
        for _ in range(5):  # warm-up
            client.post(url, content=body, headers={"content-type": "application/json"})
        for _ in range(calls):
            t = time.perf_counter()
            r = client.post(url, content=body, headers={"content-type": "application/json"})
            times.append((time.perf_counter() - t) * 1000)
            assert r.status_code == 200, r.text[:200]
    return times


async def concurrent(url_for, body: bytes, sessions: int, calls_each: int) -> list[float]:
    times: list[float] = []

    async def session(i: int) -> None:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for _ in range(calls_each):
                t = time.perf_counter()
                r = await client.post(url_for(i), content=body, headers={"content-type": "application/json"})
                times.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200

    await asyncio.gather(*(session(i) for i in range(sessions)))
    return times


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sizes", default="1000,8000,32000")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="OPTION=VALUE",
        help="extra gateway option, e.g. polar_fsync=false",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        engine_port, bare_port = procs.free_port(), procs.free_port()
        replay_engine(engine_port)
        bare = bare_mitmdump(engine_port, bare_port, root / "conf-bare")
        options = dict(item.split("=", 1) for item in args.set)
        gw = procs.start_gateway(
            f"http://127.0.0.1:{engine_port}", root / "flows", confdir=root / "conf", options=options
        )
        try:
            print(
                f"{'case':<28}{'bare p50':>10}{'bare p99':>10}{'polar p50':>11}{'polar p99':>11}"
                f"{'added p50':>11}{'ratio':>8}"
            )
            for size in (int(s) for s in args.sizes.split(",")):
                body = body_for(size)
                calls = max(20, args.calls // (1 + size // 8000))
                b = sequential(f"http://127.0.0.1:{bare_port}/v1/chat/completions", body, calls)
                p = sequential(f"{gw.reverse_url}/s/bench/v1/chat/completions", body, calls)
                report(f"{size} tokens × {calls} sequential", b, p)
            body = body_for(1000)
            b = asyncio.run(
                concurrent(
                    lambda i: f"http://127.0.0.1:{bare_port}/v1/chat/completions", body, args.sessions, 5
                )
            )
            p = asyncio.run(
                concurrent(lambda i: f"{gw.reverse_url}/s/c{i}/v1/chat/completions", body, args.sessions, 5)
            )
            report(f"{args.sessions} sessions × 5, 1k tokens", b, p)
        finally:
            gw.stop()
            procs.stop(bare)


def report(label: str, bare: list[float], polar: list[float]) -> None:
    b50, b99, p50, p99 = pct(bare, 50), pct(bare, 99), pct(polar, 50), pct(polar, 99)
    print(
        f"{label:<28}{b50:>9.2f}m{b99:>9.2f}m{p50:>10.2f}m{p99:>10.2f}m{p50 - b50:>10.2f}m{p50 / b50:>8.2f}"
    )


if __name__ == "__main__":
    main()
