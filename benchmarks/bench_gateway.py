"""Added latency of the polar addon over a bare forwarding mitmdump, to the same engine.

The engine here is a replay server that answers every chat call at once, SGLang-shaped: it serves `/model_info`
with the tiny model's tokenizer (so tokens mode, the default, is what runs), echoes `input_ids` as the prompt ids,
and for messages renders and tokenizes them with the chat template, as SGLang does (memoised, so bare and polar
pay the engine the same). Payload sizes are real: a 32k-token prompt means 32k ids coming back.

Calls come as agent sessions: a session opens with a prompt of the case's size and each next call adds the
previous answer and a ~50-token user turn, 10 calls per session — so a session's first call opens its token chain
(rendered alongside the engine call) and the others extend it (the incremental hot path).
All paths go client → mitmdump → engine over loopback, session by session, interleaved so load hits them alike:

  bare:            mitmdump --mode reverse:ENGINE       (forwards the OpenAI chat request untouched; on the same
                                                        event loop as the gateways, so "added" is the addon's)
  polar messages:  mitmdump -s addon/polar.py, polar_prompt_mode=messages (the engine renders)
  polar tokens:    the same in tokens mode, the default (decode → token-exact prompt → engine → encode →
                   fsynced record → answer)

Prints p50/p99 per prompt size, and each proxy process's CPU per call (what sets how many calls a process can
serve), for sequential calls and for concurrent sessions (`--concurrent SESSIONSxTOKENS,…`)
through 1 and N gateway processes in tokens mode (`--processes 1,2`, sessions spread across them as `--gateways N`
does), with the added latency and calls/s against the bare mitmdump measured in the same run.
Run: .venv/bin/python benchmarks/bench_gateway.py [--calls 200] [--concurrent 64x1000,256x1000] [--processes 1,2]
     [--event-loop uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import children, ports

CALLS_PER_SESSION = 10
TURN_WORDS = 50  # " word" is one token in Qwen's BPE
ANSWER = " ".join(["ok"] * 16)
JSON = {"content-type": "application/json"}


class ReplayEngine:
    """An instant SGLang-shaped engine with a real tokenizer and chat template (the tiny model's)."""

    def __init__(self, port: int) -> None:
        from transformers import AutoTokenizer

        self.model_dir = resolve_model("tiny")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        eot = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.completion = [*self.tokenizer.encode(ANSWER, add_special_tokens=False), eot]
        self._rendered: dict[
            bytes, list[int]
        ] = {}  # the engine's own rendering, memoised (same cost for all)
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/model_info", self.model_info, methods=["GET"]),
            ]
        )
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=self.server.run, daemon=True).start()
        ports.wait_port(port)

    async def model_info(self, request: Request) -> Response:
        info = {
            "model_path": str(self.model_dir),
            "tokenizer_path": str(self.model_dir),
            "weight_version": "0",
        }
        return Response(orjson.dumps(info), media_type="application/json")

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        if body.get("input_ids"):
            return body["input_ids"]
        key = orjson.dumps([body["messages"], body.get("tools"), body.get("chat_template_kwargs")])
        if key not in self._rendered:
            self._rendered[key] = self.tokenizer.apply_chat_template(
                body["messages"],
                tools=body.get("tools"),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **(body.get("chat_template_kwargs") or {}),
            )
        return self._rendered[key]

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        prompt = self.prompt_ids(body)
        answer = {
            "id": "chatcmpl-replay",
            "object": "chat.completion",
            "created": 0,
            "model": "replay",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ANSWER},
                    "finish_reason": "stop",
                    "prompt_token_ids": prompt,
                    "response_token_ids": self.completion,
                    "meta_info": {
                        "weight_version": "0",
                        "output_token_logprobs": [[-0.5, t, None] for t in self.completion],
                    },
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(self.completion),
                "total_tokens": len(prompt) + len(self.completion),
            },
        }
        return Response(orjson.dumps(answer), media_type="application/json")


def session_bodies(n_tokens: int, calls: int = CALLS_PER_SESSION) -> list[bytes]:
    """The request bodies of one agent session whose first prompt holds about `n_tokens` tokens."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the bug. " + " ".join(["word"] * n_tokens)},
    ]
    bodies = []
    for turn in range(calls):
        bodies.append(orjson.dumps({"model": "gpt", "max_tokens": 32, "messages": messages}))
        messages = [
            *messages,
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": f"Turn {turn}: " + " ".join(["word"] * TURN_WORDS)},
        ]
    return bodies


def bare_mitmdump(engine_port: int, port: int, confdir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polar_mitm.gateway.launch",  # on the same event loop as the gateways (`--event-loop`)
            "-q",
            "--mode",
            f"reverse:http://127.0.0.1:{engine_port}@{port}",
            "--set",
            f"confdir={confdir}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ports.wait_port(port, proc=proc)
    return proc


def run_session(client: httpx.Client, url: str, bodies: list[bytes], times: list[float]) -> None:
    for body in bodies:
        t = time.perf_counter()
        r = client.post(url, content=body, headers=JSON)
        times.append((time.perf_counter() - t) * 1000)
        assert r.status_code == 200, r.text[:200]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sequential(
    urls: dict[str, Any], pids: dict[str, int], bodies: list[bytes], sessions: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per-call latencies (ms) of `sessions` sessions through each path, interleaved session by session
    (`urls[name](session)` is the path's URL for that session; one warm-up session each first), and each path's
    proxy process CPU per call (ms)."""
    times: dict[str, list[float]] = {name: [] for name in urls}
    with httpx.Client(timeout=60, trust_env=False) as client:
        for url_of in urls.values():
            run_session(client, url_of("warm"), bodies, [])
        cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        for s in range(sessions):
            for name, url_of in urls.items():
                run_session(client, url_of(str(s)), bodies, times[name])
    per_call = {name: (cpu_seconds(pid) - cpu[name]) * 1e3 / len(times[name]) for name, pid in pids.items()}
    return times, per_call


async def concurrent(url_for, bodies: list[bytes], sessions: int) -> tuple[list[float], float]:
    """Per-call latencies (ms) of `sessions` sessions at once, each sending `bodies` in turn, and the calls/s."""
    times: list[float] = []
    started = time.perf_counter()

    async def session(i: int) -> None:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for body in bodies:
                t = time.perf_counter()
                r = await client.post(url_for(i), content=body, headers=JSON)
                times.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200

    await asyncio.gather(*(session(i) for i in range(sessions)))
    return times, len(times) / (time.perf_counter() - started)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200, help="sequential calls per path at 1k tokens")
    parser.add_argument("--sizes", default="1000,8000,32000")
    parser.add_argument(
        "--concurrent", default="64x1000", help="SESSIONSxTOKENS cases, comma-separated ('' for none)"
    )
    parser.add_argument("--processes", default="1,2", help="gateway processes for the concurrent cases")
    parser.add_argument(
        "--event-loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="every proxy's event loop (gateway/launch.py; polar-mitm starts its gateways on uvloop)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="OPTION=VALUE",
        help="extra gateway option, e.g. polar_fsync=false",
    )
    args = parser.parse_args()
    os.environ["POLAR_EVENT_LOOP"] = args.event_loop  # the proxies started below inherit it
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        engine_port, bare_port = ports.free_port(), ports.free_port()
        ReplayEngine(engine_port)
        engine = f"http://127.0.0.1:{engine_port}"
        bare = bare_mitmdump(engine_port, bare_port, root / "conf-bare")
        options = dict(item.split("=", 1) for item in args.set)
        gw_tokens = gateway_processes.start_gateway(
            engine, root / "flows", confdir=root / "conf", options=options
        )
        gw_messages = gateway_processes.start_gateway(
            engine,
            root / "flows-messages",
            confdir=root / "conf",
            options={**options, "polar_prompt_mode": "messages"},
        )
        pids = {"bare": bare.pid, "polar messages": gw_messages.proc.pid, "polar tokens": gw_tokens.proc.pid}
        urls = {
            "bare": lambda s: f"http://127.0.0.1:{bare_port}/v1/chat/completions",
            "polar messages": lambda s: f"{gw_messages.reverse_url}/s/m{s}/v1/chat/completions",
            "polar tokens": lambda s: f"{gw_tokens.reverse_url}/s/t{s}/v1/chat/completions",
        }
        try:
            print(
                f"sessions of {CALLS_PER_SESSION} calls (each adds the answer and a {TURN_WORDS}-token turn)"
            )
            print(
                f"{'case':<30}{'bare p50':>10}{'bare p99':>10}  "
                f"{'messages p50/p99 added':>26}  {'tokens p50/p99 added':>24}  "
                f"{'proxy CPU per call bare/messages/tokens':>40}"
            )
            for size in (int(s) for s in args.sizes.split(",")):
                sessions = max(2, args.calls // CALLS_PER_SESSION // (1 + size // 8000))
                times, cpu = sequential(urls, pids, session_bodies(size), sessions)
                report(f"{size} tokens × {sessions * CALLS_PER_SESSION} sequential", times, cpu)
            concurrent_cases(args, engine, bare_port, root, options)
        finally:
            gw_tokens.stop()
            gw_messages.stop()
            children.stop(bare)


def concurrent_cases(args, engine: str, bare_port: int, root: Path, options: dict[str, str]) -> None:
    """Each SESSIONSxTOKENS case (5 calls per session) through the bare mitmdump, then 1 and N gateways."""
    cases = [tuple(int(x) for x in case.split("x")) for case in args.concurrent.split(",") if case.strip()]
    if not cases:
        return
    bare_runs = {}
    bare_url = f"http://127.0.0.1:{bare_port}/v1/chat/completions"
    for sessions, tokens in cases:
        bodies = session_bodies(tokens, 5)
        asyncio.run(concurrent(lambda i: bare_url, bodies, 1))  # warm: the engine renders each prompt once
        bare_runs[sessions, tokens] = asyncio.run(concurrent(lambda i: bare_url, bodies, sessions))
    print(
        f"\n{'concurrent case (tokens mode)':<34}{'calls/s':>9}{'p50':>10}{'p99':>10}{'added p50':>11}"
        f"{'× bare calls/s':>16}"
    )
    for (sessions, tokens), (times, rate) in bare_runs.items():
        print(
            f"{f'{sessions} × 5, {tokens} tokens, bare':<34}{rate:>9.1f}{pct(times, 50):>9.1f}m{pct(times, 99):>9.1f}m"
        )
    for n in (int(x) for x in args.processes.split(",")):
        with gateway_processes.gateways_running(
            [engine] * n, root / f"flows-{n}", confdir=root / "conf", options=options
        ) as gateways:
            for sessions, tokens in cases:
                urls = [gw.reverse_url for gw in gateways]
                bodies = session_bodies(tokens, 5)
                times, rate = asyncio.run(
                    concurrent(
                        lambda i, urls=urls, n=n: f"{urls[i % n]}/s/c{i}/v1/chat/completions",
                        bodies,
                        sessions,
                    )
                )
                bare_times, bare_rate = bare_runs[sessions, tokens]
                label = f"{sessions} × 5, {tokens} tokens, polar ×{n}"
                print(
                    f"{label:<34}{rate:>9.1f}{pct(times, 50):>9.1f}m{pct(times, 99):>9.1f}m"
                    f"{pct(times, 50) - pct(bare_times, 50):>10.1f}m{rate / bare_rate:>16.2f}"
                )


def report(label: str, times: dict[str, list[float]], cpu: dict[str, float]) -> None:
    bare = times["bare"]
    b50, b99 = pct(bare, 50), pct(bare, 99)
    cells = []
    for name in ("polar messages", "polar tokens"):
        p50, p99 = pct(times[name], 50), pct(times[name], 99)
        cells.append(f"{p50:>7.2f}/{p99:>6.2f}m {p50 - b50:>+7.2f}m")
    cpu_cells = " / ".join(f"{cpu[name]:.2f}" for name in ("bare", "polar messages", "polar tokens"))
    print(f"{label:<30}{b50:>9.2f}m{b99:>9.2f}m  {cells[0]:>26}  {cells[1]:>24}  {cpu_cells + ' ms':>40}")


if __name__ == "__main__":
    main()
