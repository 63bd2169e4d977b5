"""Added latency of the polar addon over a bare forwarding mitmdump, to the same engine.

The engine here is a replay server that answers every chat call at once with an SGLang-shaped answer carrying the
prompt's token ids (so payload sizes are real: a 32k-token prompt means 32k ids coming back), which isolates the
gateway's own cost from model time. Both paths go client → mitmdump → engine over loopback:

  bare:  mitmdump --mode reverse:ENGINE           (forwards the OpenAI chat request untouched)
  polar: mitmdump -s addon/polar.py (reverse)     (decode → engine → encode → fsynced record → answer)

Prints p50/p99 per prompt size, for sequential calls and for concurrent sessions (`--concurrent SESSIONSxTOKENS,…`)
through 1 and N gateway processes (`--processes 1,2`, sessions spread across them as `--gateways N` does), with the
added latency and calls/s against the bare mitmdump measured in the same run.
Run: .venv/bin/python benchmarks/bench_gateway.py [--calls 200] [--concurrent 64x1000,256x1000] [--processes 1,2]
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


async def concurrent(url_for, body: bytes, sessions: int, calls_each: int) -> tuple[list[float], float]:
    """Per-call latencies (ms) of `sessions` sessions × `calls_each` calls at once, and the calls per second."""
    times: list[float] = []
    started = time.perf_counter()

    async def session(i: int) -> None:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for _ in range(calls_each):
                t = time.perf_counter()
                r = await client.post(url_for(i), content=body, headers={"content-type": "application/json"})
                times.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200

    await asyncio.gather(*(session(i) for i in range(sessions)))
    return times, len(times) / (time.perf_counter() - started)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sizes", default="1000,8000,32000")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument(
        "--concurrent", default="64x1000", help="SESSIONSxTOKENS cases, comma-separated ('' for none)"
    )
    parser.add_argument("--processes", default="1,2", help="gateway processes for the concurrent cases")
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
            concurrent_cases(args, engine_port, bare_port, root, options)
        finally:
            gw.stop()
            procs.stop(bare)


def concurrent_cases(args, engine_port: int, bare_port: int, root: Path, options: dict[str, str]) -> None:
    """Each SESSIONSxTOKENS case through the bare mitmdump, then through 1 and N gateway processes."""
    cases = [tuple(int(x) for x in case.split("x")) for case in args.concurrent.split(",") if case.strip()]
    if not cases:
        return
    engine = f"http://127.0.0.1:{engine_port}"
    bare_runs = {}
    for sessions, tokens in cases:
        bare_url = f"http://127.0.0.1:{bare_port}/v1/chat/completions"
        bare_runs[sessions, tokens] = asyncio.run(
            concurrent(lambda i, url=bare_url: url, body_for(tokens), sessions, 5)
        )
    print(
        f"\n{'concurrent case':<34}{'calls/s':>9}{'p50':>10}{'p99':>10}{'added p50':>11}{'× bare calls/s':>16}"
    )
    for (sessions, tokens), (times, rate) in bare_runs.items():
        print(
            f"{f'{sessions} × 5, {tokens} tokens, bare':<34}{rate:>9.1f}{pct(times, 50):>9.1f}m{pct(times, 99):>9.1f}m"
        )
    for n in (int(x) for x in args.processes.split(",")):
        with procs.gateways_running(
            [engine] * n, root / f"flows-{n}", confdir=root / "conf", options=options
        ) as gateways:
            for sessions, tokens in cases:
                urls = [gw.reverse_url for gw in gateways]
                times, rate = asyncio.run(
                    concurrent(
                        lambda i, urls=urls, n=n: f"{urls[i % n]}/s/c{i}/v1/chat/completions",
                        body_for(tokens),
                        sessions,
                        5,
                    )
                )
                bare_times, bare_rate = bare_runs[sessions, tokens]
                label = f"{sessions} × 5, {tokens} tokens, polar ×{n}"
                print(
                    f"{label:<34}{rate:>9.1f}{pct(times, 50):>9.1f}m{pct(times, 99):>9.1f}m"
                    f"{pct(times, 50) - pct(bare_times, 50):>10.1f}m{rate / bare_rate:>16.2f}"
                )


def report(label: str, bare: list[float], polar: list[float]) -> None:
    b50, b99, p50, p99 = pct(bare, 50), pct(bare, 99), pct(polar, 50), pct(polar, 99)
    print(
        f"{label:<28}{b50:>9.2f}m{b99:>9.2f}m{p50:>10.2f}m{p99:>10.2f}m{p50 - b50:>10.2f}m{p50 / b50:>8.2f}"
    )


if __name__ == "__main__":
    main()
