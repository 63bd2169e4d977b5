"""Weight pushes under running sessions (issue 43), embedded engine: sessions dropped per push, the pause a push
costs, and the tokens per weight version in the records against what the engine counted.

One engine (`polar-mitm serve --model tiny`, scripted so every call samples the same `--sampled` tokens, each with
the model's own logprob, `--token-delay` apart), one gateway, `--sessions` concurrent streaming sessions (OpenAI
Chat wire format), and a push every `--push-every` seconds alternating two checkpoints (tiny seeds 0 and 1). A push
lands between two tokens of the running generation (engine/generation.py), so no session waits it out or is
dropped. Per push: its latency (request → the engine serves the new version: the checkpoint load, then the next
token boundary) and the stall the streams saw (the longest gap between two chunks of any stream minus the median
gap). At the end: the records' version spans summed per version, and the engine's own count (`/engine_stats`);
and what a trainer's step-0 check would see (train/behaviour_check.py's `logp_diff`): every recorded logprob scored
again by the weights its own span names, beside the same tokens scored by the one version the record's
`weight_version` names (what a record without spans says) — the second is the error per-token versions remove.

    .venv/bin/python benchmarks/bench_inflight_update.py [--sessions 8] [--sampled 256] [--push-every 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines.weights import push_weights
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import children
from polar_mitm.storage.records import read_all, version_spans_of


def answer_text(sampled: int) -> str:
    """An answer of exactly `sampled - 1` tokens (+ end of turn)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    answer = " ".join(["word"] * (sampled - 1))
    assert len(tok.encode(answer)) == sampled - 1
    return answer


def stream_session(url: str, body: dict, out: dict) -> None:
    """One streamed call: its chunk arrival times, whether it ended with [DONE] and a finish reason."""
    times, finish = [], None
    try:
        with httpx.stream(
            "POST", url, json=body, headers={"authorization": "Bearer bench"}, timeout=600
        ) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                if not line.startswith("data: {"):
                    continue
                times.append(time.perf_counter())
                for choice in json.loads(line[6:]).get("choices") or ():
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        out["error"] = str(exc)
    out["times"], out["finish"] = times, finish


def record_tokens_by_version(flows: Path) -> Counter:
    counts: Counter = Counter()
    for row in read_all(flows).to_pylist():
        spans = version_spans_of(row["version_spans"], row["weight_version"])
        ends = [s for s, _ in spans[1:]] + [len(row["completion_ids"])]
        for (start, version), end in zip(spans, ends, strict=True):
            counts[str(version)] += end - start
    return counts


def step0_logp_diff(flows: Path, checkpoint_of: dict[str, Path]) -> tuple[float, float, int, int]:
    """Mean |recomputed - recorded| over the sampled tokens of the records a push split (the tokens a version
    change touches), scored per span's version and by the record's one version; and the records and tokens so
    compared."""
    from polar_mitm.engine.generation import Engine

    engines = {version: Engine(path) for version, path in checkpoint_of.items()}
    per_span, per_record, tokens, records = 0.0, 0.0, 0, 0
    for row in read_all(flows).to_pylist():
        spans = version_spans_of(row["version_spans"], row["weight_version"])
        if len(spans) < 2:
            continue
        records += 1
        prompt, sampled, recorded = row["prompt_ids"], row["completion_ids"], row["completion_logprobs"]
        whole = {
            v: engines[v].score(prompt, sampled) for v in {row["weight_version"], *(v for _, v in spans)}
        }
        ends = [s for s, _ in spans[1:]] + [len(sampled)]
        for (start, version), end in zip(spans, ends, strict=True):
            for i in range(start, end):
                per_span += abs(whole[version][i] - recorded[i])
                per_record += abs(whole[row["weight_version"]][i] - recorded[i])
        tokens += len(sampled)
    return per_span / max(tokens, 1), per_record / max(tokens, 1), records, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--sampled", type=int, default=256)
    parser.add_argument("--token-delay", type=float, default=0.005)
    parser.add_argument("--push-every", type=float, default=3.0)
    args = parser.parse_args()
    answer = answer_text(args.sampled)
    root = Path(tempfile.mkdtemp(prefix="bench-inflight-"))
    script = root / "script.json"
    script.write_text(json.dumps({"turns": [answer], "side": answer}))
    engine, engine_url = engine_processes.start_engine(
        "tiny",
        log=root / "engine.log",
        extra_args=["--script", str(script), "--token-delay", str(args.token_delay)],
    )
    gateway = gateway_processes.start_gateway(
        engine_url, root / "flows", confdir=root / "conf", log=root / "gw.log"
    )
    checkpoints = [resolve_model("tiny", seed=1), resolve_model("tiny")]
    first_version = httpx.get(
        f"{engine_url}/model_info", headers=engine_keys.auth_headers(engine_url), timeout=10
    ).json()["weight_version"]
    checkpoint_of = {str(first_version): resolve_model("tiny")}
    body = {
        "model": "gpt-4.1",
        "stream": True,
        "max_tokens": args.sampled,
        "messages": [{"role": "user", "content": "hi"}],
    }
    results = [{} for _ in range(args.sessions)]
    pushes: list[tuple[float, float]] = []  # (start, end) perf_counter
    try:
        threads = [
            threading.Thread(
                target=stream_session,
                args=(f"{gateway.reverse_url}/s/b{uuid.uuid4().hex[:8]}/v1/chat/completions", body, out),
            )
            for out in results
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(args.push_every)
            if not any(t.is_alive() for t in threads):
                break
            start = time.perf_counter()
            version = push_weights(engine_url, checkpoints[len(pushes) % 2])
            checkpoint_of[str(version)] = checkpoints[len(pushes) % 2]
            pushes.append((start, time.perf_counter()))
        for t in threads:
            t.join()
        time.sleep(1.0)  # the last records reach the journal
        stats = httpx.get(
            f"{engine_url}/engine_stats", headers=engine_keys.auth_headers(engine_url), timeout=10
        ).json()
        recorded = record_tokens_by_version(root / "flows")
    finally:
        gateway.stop()
        children.stop(engine)
    dropped = sum(1 for r in results if not r.get("done") or r.get("finish") not in ("stop", "length"))
    # From each stream's first token on (before it, a session waits its turn: the engine runs one generation at once)
    gaps = [b - a for r in results for a, b in zip(r["times"][1:], r["times"][2:], strict=False)]
    median_gap = statistics.median(gaps) if gaps else 0.0
    print(
        f"{args.sessions} sessions × {args.sampled} tokens, {len(pushes)} pushes every {args.push_every} s\n"
    )
    print(f"sessions dropped: {dropped} in all, {dropped / max(len(pushes), 1):.2f} per push")
    for i, (start, end) in enumerate(pushes):
        window = [
            b - a
            for r in results
            for a, b in zip(r["times"][1:], r["times"][2:], strict=False)
            if start <= b <= end + 0.5
        ]
        stall = (max(window) - median_gap) * 1000 if window else 0.0
        print(
            f"push {i + 1}: {(end - start) * 1000:.0f} ms to serve the new version, stream stall {stall:.1f} ms"
        )
    engine_counts = {k: v for k, v in stats.get("tokens_by_version", {}).items()}
    print(f"median gap between chunks: {median_gap * 1000:.1f} ms")
    print(f"tokens per version, records: {dict(sorted(recorded.items()))}")
    print(f"tokens per version, engine:  {dict(sorted(engine_counts.items()))}")
    print("equal" if dict(recorded) == engine_counts else "DIFFERENT")
    per_span, per_record, records, tokens = step0_logp_diff(root / "flows", checkpoint_of)
    print(
        f"step-0 logp_diff over the {tokens} sampled tokens of the {records} records a push split: "
        f"{per_span:.2e} scored per span's version, {per_record:.2e} scored by the record's one version "
        f"({per_record / max(per_span, 1e-12):.0f}x)"
    )


if __name__ == "__main__":
    main()
