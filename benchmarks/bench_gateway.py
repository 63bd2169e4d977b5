"""Added latency of the gateway over the engine and over the floors it is measured against, to the same engine.

The engine here is a replay server that answers every chat call at once, SGLang-shaped: it serves `/model_info`
with the tiny model's tokenizer (so tokens mode, the default, is what runs), echoes `input_ids` as the prompt ids,
and for messages renders and tokenizes them with the chat template, as SGLang does (memoised, so bare and polar
pay the engine the same). Payload sizes are real: a 32k-token prompt means 32k ids coming back.

Calls come as agent sessions: a session opens with a prompt of the case's size and each next call adds the
previous answer and a ~50-token user turn, 10 calls per session — so a session's first call opens its token chain
(rendered alongside the engine call) and the others extend it (the incremental hot path).
Every route is measured in one run, session by session, interleaved so load hits them alike (tokens mode, the
default: decode → token-exact prompt → engine → encode → fsynced record → answer):

  engine:                straight to the engine (its own process)
  bare mitmdump reverse: mitmdump --mode reverse:ENGINE, no addon (on the same event loop as the gateways)
  aiohttp forwarder:     the floor of a Python gateway on our HTTP stack: aiohttp's server and client passing the
                         body through untouched (`serve_forwarder`)
  base URL, ours:        polar-mitm's base-URL server (gateway/base_url_server.py)
  base URL, mitmproxy:   the same gateway with base URLs on mitmproxy's reverse mode
  bare mitmdump proxy:   HTTPS_PROXY-style through mitmdump with no addon
  proxy mode:            the gateway as HTTPS_PROXY, the session in the proxy user

Prints p50/p99 per prompt size, and each proxy process's CPU per call (what sets how many calls a process can
serve), for sequential calls and for concurrent sessions (`--concurrent SESSIONSxTOKENS,…`)
through 1 and N gateway processes in tokens mode (`--processes 1,2`, sessions spread across them as `--gateways N`
does), with the added latency and calls/s against the engine measured in the same run.
Run: .venv/bin/python benchmarks/bench_gateway.py [--calls 200] [--concurrent 64x1000,256x1000] [--processes 1,2]
     [--event-loop uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as StarletteRoute

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
                StarletteRoute("/v1/chat/completions", self.chat, methods=["POST"]),
                StarletteRoute("/model_info", self.model_info, methods=["GET"]),
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


def serve_replay_engine(port: int) -> None:
    ReplayEngine(port)
    threading.Event().wait()


def start_replay_engine(port: int) -> multiprocessing.Process:
    """The replay engine in a process of its own (as a real engine is: no GIL shared with the clients)."""
    proc = multiprocessing.get_context("fork").Process(target=serve_replay_engine, args=(port,), daemon=True)
    proc.start()
    ports.wait_port(port, timeout=120)
    return proc


def serve_forwarder(port: int, engine: str, event_loop: str) -> None:
    """The floor of any Python gateway on our HTTP stack: aiohttp's low-level server (as `BaseUrlServer`) reads the
    request and posts its body unchanged to the engine with one pooled aiohttp session (as `EngineClient`), then
    answers the engine's bytes. No decoding, prompt, record or journal: what is left over it is the gateway's work."""
    import aiohttp
    from aiohttp import web

    async def run() -> None:
        session = aiohttp.ClientSession(trust_env=False)

        async def forward(request: web.BaseRequest) -> web.Response:
            body = await request.read()
            async with session.post(engine + request.raw_path, data=body, headers=JSON) as answer:
                payload = await answer.read()
            return web.Response(status=answer.status, body=payload, content_type="application/json")

        runner = web.ServerRunner(web.Server(forward, access_log=None))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    if event_loop == "uvloop":
        import uvloop

        uvloop.run(run())
    else:
        asyncio.run(run())


def start_forwarder(port: int, engine: str, event_loop: str) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(
        target=serve_forwarder, args=(port, engine, event_loop), daemon=True
    )
    proc.start()
    ports.wait_port(port, timeout=60)
    return proc


def bare_mitmdump(mode: str, port: int, confdir: Path) -> subprocess.Popen:
    """mitmdump with no addon in `mode` (`reverse:ENGINE` or `regular`) at `port`."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polar_mitm.gateway.launch",  # on the same event loop as the gateways (`--event-loop`)
            "-q",
            "--mode",
            f"{mode}@{port}",
            "--set",
            f"confdir={confdir}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ports.wait_port(port, proc=proc)
    return proc


@contextmanager
def base_url_server(server: str) -> Iterator[None]:
    """Gateways started in this block serve base URLs on `server` (`polar` or `mitmproxy`)."""
    before = os.environ.get(gateway_processes.BASE_URL_SERVER_ENV)
    os.environ[gateway_processes.BASE_URL_SERVER_ENV] = server
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(gateway_processes.BASE_URL_SERVER_ENV)
        else:
            os.environ[gateway_processes.BASE_URL_SERVER_ENV] = before


@dataclass
class Route:
    """One way to the engine: the client and URL for a session (`via`), the proxy process in the way (for its
    CPU), and the route its added latency is measured against."""

    via: Callable[[str], tuple[httpx.Client, str]]
    pid: int | None = None
    baseline: str | None = None


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
    routes: dict[str, Route], bodies: list[bytes], sessions: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per-call latencies (ms) of `sessions` sessions through each route, interleaved session by session (one
    warm-up session each first), and the CPU per call (ms) of each route's proxy process."""
    times: dict[str, list[float]] = {name: [] for name in routes}
    for route in routes.values():
        run_session(*route.via("warm"), bodies, [])
    cpu = {name: cpu_seconds(route.pid) for name, route in routes.items() if route.pid}
    for s in range(sessions):
        for name, route in routes.items():
            run_session(*route.via(str(s)), bodies, times[name])
    per_call = {
        name: (cpu_seconds(route.pid) - cpu[name]) * 1e3 / len(times[name])
        for name, route in routes.items()
        if route.pid
    }
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
    parser.add_argument(
        "--processes", default="1,auto", help="gateway processes for the concurrent cases (auto: the cores)"
    )
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
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        root = Path(tmp)
        engine_port, reverse_port, regular_port = ports.free_port(), ports.free_port(), ports.free_port()
        engine_proc = start_replay_engine(engine_port)
        stack.callback(engine_proc.kill)
        engine = f"http://127.0.0.1:{engine_port}"
        bare_reverse = bare_mitmdump(f"reverse:{engine}", reverse_port, root / "conf-bare")
        bare_regular = bare_mitmdump("regular", regular_port, root / "conf-bare")
        stack.callback(children.stop, bare_reverse)
        stack.callback(children.stop, bare_regular)
        forwarder_port = ports.free_port()
        forwarder = start_forwarder(forwarder_port, engine, args.event_loop)
        stack.callback(forwarder.kill)
        options = dict(item.split("=", 1) for item in args.set)
        ours = gateway_processes.start_gateway(engine, root / "flows", confdir=root / "conf", options=options)
        stack.callback(ours.stop)
        with base_url_server("mitmproxy"):
            mitm = gateway_processes.start_gateway(
                engine, root / "flows-mitm", confdir=root / "conf", options=options
            )
        stack.callback(mitm.stop)
        proxying = gateway_processes.start_gateway(  # its own process: each route's CPU is its own
            engine, root / "flows-proxy", confdir=root / "conf", options=options
        )
        stack.callback(proxying.stop)
        plain = stack.enter_context(httpx.Client(timeout=60, trust_env=False))
        via_bare = stack.enter_context(
            httpx.Client(timeout=60, trust_env=False, proxy=f"http://127.0.0.1:{regular_port}")
        )
        proxied: dict[str, httpx.Client] = {}

        def proxy_mode(session: str) -> tuple[httpx.Client, str]:
            """A client per session: the session rides in its proxy user, as a harness's does."""
            if session not in proxied:
                proxy = f"http://p{session}:x@127.0.0.1:{proxying.proxy_port}"
                proxied[session] = stack.enter_context(httpx.Client(timeout=60, trust_env=False, proxy=proxy))
            return proxied[session], "http://api.openai.com/v1/chat/completions"

        chat = "/v1/chat/completions"
        routes = {
            "engine": Route(lambda s: (plain, f"{engine}{chat}")),
            "bare mitmdump reverse": Route(
                lambda s: (plain, f"http://127.0.0.1:{reverse_port}{chat}"), bare_reverse.pid
            ),
            "aiohttp forwarder": Route(
                lambda s: (plain, f"http://127.0.0.1:{forwarder_port}{chat}"), forwarder.pid, "engine"
            ),
            "base URL, ours": Route(
                lambda s: (plain, f"{ours.reverse_url}/s/o{s}{chat}"), ours.proc.pid, "engine"
            ),
            "base URL, mitmproxy": Route(
                lambda s: (plain, f"{mitm.reverse_url}/s/m{s}{chat}"), mitm.proc.pid, "engine"
            ),
            "bare mitmdump proxy": Route(lambda s: (via_bare, f"{engine}{chat}"), bare_regular.pid),
            "proxy mode": Route(proxy_mode, proxying.proc.pid, "bare mitmdump proxy"),
        }
        print(f"sessions of {CALLS_PER_SESSION} calls (each adds the answer and a {TURN_WORDS}-token turn)")
        print(
            f"{'case':<18}{'route':<24}{'p50':>9}{'p99':>9}{'added p50':>11}{'added p99':>11}{'CPU/call':>10}"
        )
        for size in (int(s) for s in args.sizes.split(",")):
            sessions = max(2, args.calls // CALLS_PER_SESSION // (1 + size // 8000))
            times, cpu = sequential(routes, session_bodies(size), sessions)
            report(f"{size} tok × {sessions * CALLS_PER_SESSION}", routes, times, cpu)
        concurrent_cases(args, engine, reverse_port, root, options)


def concurrent_cases(args, engine: str, reverse_port: int, root: Path, options: dict[str, str]) -> None:
    """Each SESSIONSxTOKENS case (5 calls per session) straight to the engine, through the bare mitmdump, then
    through 1 and N gateways (base URLs on our server; ×1 on mitmproxy's reverse mode too)."""
    cases = [tuple(int(x) for x in case.split("x")) for case in args.concurrent.split(",") if case.strip()]
    if not cases:
        return
    print(
        f"\n{'concurrent case (tokens mode)':<40}{'calls/s':>9}{'p50':>10}{'p99':>10}"
        f"{'added p50 (engine)':>20}{'× engine calls/s':>18}"
    )
    straight: dict[tuple[int, int], tuple[list[float], float]] = {}
    chat = "/v1/chat/completions"
    for sessions, tokens in cases:
        bodies = session_bodies(tokens, 5)
        asyncio.run(
            concurrent(lambda i: f"{engine}{chat}", bodies, 1)
        )  # warm: the engine renders each prompt
        straight[sessions, tokens] = asyncio.run(concurrent(lambda i: f"{engine}{chat}", bodies, sessions))
        bare = asyncio.run(concurrent(lambda i: f"http://127.0.0.1:{reverse_port}{chat}", bodies, sessions))
        show(f"{sessions} × 5, {tokens} tok, engine", straight[sessions, tokens], straight[sessions, tokens])
        show(f"{sessions} × 5, {tokens} tok, bare mitmdump", bare, straight[sessions, tokens])
    counts = [os.cpu_count() or 1 if x == "auto" else int(x) for x in args.processes.split(",")]
    runs = [("ours", n) for n in dict.fromkeys(counts)] + [("mitmproxy", 1)]
    for server, n in runs:
        with (
            base_url_server("polar" if server == "ours" else "mitmproxy"),
            gateway_processes.gateways_running(
                [engine] * n, root / f"flows-{server}-{n}", confdir=root / "conf", options=options
            ) as gateways,
        ):
            urls = [gw.reverse_url for gw in gateways]
            for sessions, tokens in cases:
                run = asyncio.run(
                    concurrent(
                        lambda i, urls=urls, n=n: f"{urls[i % n]}/s/c{i}{chat}",
                        session_bodies(tokens, 5),
                        sessions,
                    )
                )
                show(f"{sessions} × 5, {tokens} tok, polar ×{n} ({server})", run, straight[sessions, tokens])


def show(label: str, run: tuple[list[float], float], engine: tuple[list[float], float]) -> None:
    (times, rate), (engine_times, engine_rate) = run, engine
    print(
        f"{label:<40}{rate:>9.1f}{pct(times, 50):>9.1f}m{pct(times, 99):>9.1f}m"
        f"{pct(times, 50) - pct(engine_times, 50):>+19.1f}m{rate / engine_rate:>18.2f}"
    )


def report(
    label: str, routes: dict[str, Route], times: dict[str, list[float]], cpu: dict[str, float]
) -> None:
    for i, (name, route) in enumerate(routes.items()):
        p50, p99 = pct(times[name], 50), pct(times[name], 99)
        added = ""
        if route.baseline is not None:
            base = times[route.baseline]
            added = f"{p50 - pct(base, 50):>+10.2f}m{p99 - pct(base, 99):>+10.2f}m"
        else:
            added = f"{'':>22}"
        cpu_cell = f"{cpu[name]:>8.2f}ms" if name in cpu else ""
        print(f"{label if i == 0 else '':<18}{name:<24}{p50:>8.2f}m{p99:>8.2f}m{added}{cpu_cell:>10}")


if __name__ == "__main__":
    main()
