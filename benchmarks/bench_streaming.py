"""Live streaming: time to first content byte and total time, through the gateway vs directly from the engine.

One run, one engine (`polar-mitm serve --model tiny`, scripted so every call samples exactly the same 256 tokens
— the model's own logprobs are still computed for each), two gateways in front of it: `polar_stream=live` and
`polar_stream=replay`. Each call sends an 8k-token prompt (a fresh session each time, so no cache helps) and
streams the answer with the OpenAI Chat SDK's wire format; the clock stops at the first content delta (TTFB) and
at `[DONE]` (total). Calls alternate between the three paths so drift on a busy machine hits all of them alike.

    .venv/bin/python benchmarks/bench_streaming.py [--calls 5] [--prompt-tokens 8192] [--sampled 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.engines import processes as engine_processes
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import children


def texts(prompt_tokens: int, sampled: int) -> tuple[str, str]:
    """A user message of ~`prompt_tokens` tokens and an answer of exactly `sampled - 1` tokens (+ end of turn)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    prompt = " ".join(words[i % len(words)] for i in range(prompt_tokens - 40))
    answer = " ".join(["word"] * (sampled - 1))
    assert len(tok.encode(answer)) == sampled - 1, "the answer must be sampled - 1 tokens"
    return prompt, answer


def timed_stream(url: str, body: dict, headers: dict[str, str]) -> tuple[float, float, int]:
    """(seconds to the first content delta, seconds to the end, content characters) of one streamed call."""
    start = time.perf_counter()
    first = None
    chars = 0
    with httpx.stream("POST", url, json=body, headers=headers, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    chars += len(content)
                    if first is None:
                        first = time.perf_counter() - start
    return (first or float("nan")), time.perf_counter() - start, chars


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--sampled", type=int, default=256)
    args = parser.parse_args()
    prompt, answer = texts(args.prompt_tokens, args.sampled)
    root = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    script = root / "script.json"
    script.write_text(json.dumps({"turns": [answer], "side": answer}))
    engine, engine_url = engine_processes.start_engine(
        "tiny", log=root / "engine.log", extra_args=["--script", str(script)]
    )
    live = gateway_processes.start_gateway(
        engine_url, root / "live", confdir=root / "conf", log=root / "live.log"
    )
    replay = gateway_processes.start_gateway(
        engine_url,
        root / "replay",
        confdir=root / "conf",
        log=root / "replay.log",
        options={"polar_stream": "replay"},
    )
    body = {
        "model": "gpt-4.1",
        "stream": True,
        "max_tokens": args.sampled,
        "messages": [{"role": "user", "content": prompt}],
    }
    engine_body = {
        **body,
        "logprobs": True,
        "return_input_ids_in_sglext": True,
        "return_output_ids_in_sglext": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
    }
    results: dict[str, list[tuple[float, float]]] = {
        "engine direct": [],
        "gateway live": [],
        "gateway replay": [],
    }
    try:
        for i in range(args.calls + 1):  # the first round warms every path up and is not counted
            for name, url, payload in (
                ("engine direct", f"{engine_url}/v1/chat/completions", engine_body),
                ("gateway live", f"{live.reverse_url}/s/b{uuid.uuid4().hex[:8]}/v1/chat/completions", body),
                (
                    "gateway replay",
                    f"{replay.reverse_url}/s/b{uuid.uuid4().hex[:8]}/v1/chat/completions",
                    body,
                ),
            ):
                ttfb, total, chars = timed_stream(url, payload, {"authorization": "Bearer bench"})
                assert chars == len(answer), (name, chars)
                if i:
                    results[name].append((ttfb, total))
    finally:
        live.stop()
        replay.stop()
        children.stop(engine)
    print(
        f"{args.prompt_tokens}-token prompt, {args.sampled} sampled tokens, {args.calls} calls each (median):\n"
    )
    print("| path | TTFB | total |")
    print("|---|---|---|")
    for name, rows in results.items():
        ttfb = statistics.median(r[0] for r in rows)
        total = statistics.median(r[1] for r in rows)
        print(f"| {name} | {ttfb * 1000:.1f} ms | {total * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
