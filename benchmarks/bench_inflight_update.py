"""Weight pushes under running sessions (issue 43), on the embedded engine or vLLM (CPU): sessions dropped per push,
the pause a push costs, and the tokens per weight version in the records against what the engine counted.

One engine, scripted so every call samples the same `--sampled` tokens, each with the model's own logprob — the
embedded engine (`polar-mitm serve --model tiny`, `--token-delay` apart) or `--engine vllm` (`polar-mitm vllm serve
tiny`, the project's launcher: the tiny model at vLLM's head_dim, its scripted policy) — one gateway,
`--sessions` concurrent streaming sessions (OpenAI Chat wire format), and a push every `--push-every` seconds
alternating two checkpoints (tiny seeds 0 and 1). On the embedded engine a push lands between two tokens of the
running generation (engine/generation.py); on vLLM it pauses with the calls kept (`/pause?mode=keep`) — so no
session waits it out or is dropped. Per push: its latency (request → the engine serves the new version), the pause
the engine's dialect measured (`PushReport.pause_seconds`: vLLM's pause→resume, the embedded engine's re-prefill),
and the stall the streams saw (the longest gap between two chunks of any stream minus the median gap). At the end:
the records' version spans summed per version, and the engine's own count (`/engine_stats` on the embedded engine;
on vLLM the spans are vLLM's own `weight_versions`); and what a trainer's step-0 check would see
(train/behaviour_check.py's `logp_diff`): every recorded logprob scored again by the weights its own span names,
beside the same tokens scored by the one version the record's `weight_version` names (what a record without spans
says) — the second is the error per-token versions remove. On vLLM, today's behaviour is measured beside it: one
push with `/pause?mode=wait` under the same sessions (the push waits for the longest call in flight).

    .venv/bin/python benchmarks/bench_inflight_update.py [--engine embedded|vllm] [--sessions 8] [--sampled 256]
        [--push-every 3]
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
from polar_mitm.engines.dialects import DIALECTS
from polar_mitm.engines.dialects.base import PushReport
from polar_mitm.engines.weights import engine_weight_version, push_weights_reported
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import children
from polar_mitm.storage.records import read_all, version_spans_of
from polar_mitm.vllm.server import resolve_vllm_model, start_vllm, stop_vllm


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


def start_engine(kind: str, root: Path, answer: str, token_delay: float):
    """(engine URL, its stop, its two checkpoints [pushed first, served first]) for `kind`, playing `answer`."""
    script = root / "script.json"
    script.write_text(json.dumps({"turns": [answer], "side": answer}))
    if kind == "vllm":
        proc, url = start_vllm("tiny", log=root / "engine.log", script=script)
        checkpoints = [resolve_vllm_model("tiny", seed=1), resolve_vllm_model("tiny")]
        return url, lambda: stop_vllm(proc), checkpoints
    proc, url = engine_processes.start_engine(
        "tiny",
        log=root / "engine.log",
        extra_args=["--script", str(script), "--token-delay", str(token_delay)],
    )
    return url, lambda: children.stop(proc), [resolve_model("tiny", seed=1), resolve_model("tiny")]


def run_sessions(gateway, engine_url: str, body: dict, sessions: int, push) -> tuple[list[dict], list]:
    """`sessions` streaming sessions at once; `push()` every time it returns a wait in seconds, while they run.
    Returns each session's result and each push's (start, end, report)."""
    results: list[dict] = [{} for _ in range(sessions)]
    threads = [
        threading.Thread(
            target=stream_session,
            args=(f"{gateway.reverse_url}/s/b{uuid.uuid4().hex[:8]}/v1/chat/completions", body, out),
        )
        for out in results
    ]
    for t in threads:
        t.start()
    pushes = []
    while (wait := push.wait(len(pushes))) is not None and any(t.is_alive() for t in threads):
        time.sleep(wait)
        if not any(t.is_alive() for t in threads):
            break
        start = time.perf_counter()
        report = push(len(pushes))
        pushes.append((start, time.perf_counter(), report))
    for t in threads:
        t.join()
    return results, pushes


class Pushes:
    """Alternating checkpoints pushed into the engine, every `every` seconds (at most `limit` pushes)."""

    def __init__(
        self,
        engine_url: str,
        checkpoints: list[Path],
        every: float,
        limit: int | None = None,
        checkpoint_of: dict[str, Path] | None = None,
    ):
        self.engine_url, self.checkpoints, self.every, self.limit = engine_url, checkpoints, every, limit
        # Which checkpoint each version served (the first: the engine's own).
        self.checkpoint_of = checkpoint_of or {str(engine_weight_version(engine_url)): checkpoints[1]}

    def wait(self, done: int) -> float | None:
        return None if self.limit is not None and done >= self.limit else self.every

    def __call__(self, done: int) -> PushReport:
        checkpoint = self.checkpoints[done % 2]
        report = push_weights_reported(self.engine_url, checkpoint)
        self.checkpoint_of[report.weight_version] = checkpoint
        return report


def stalls(results: list[dict], pushes: list) -> tuple[float, list[float]]:
    """The median gap between two chunks of a stream, and each push's stall (its window's longest gap minus it)."""
    # From each stream's first token on (before it, a session may wait its turn: the embedded engine runs one
    # generation at once)
    gaps = [b - a for r in results for a, b in zip(r["times"][1:], r["times"][2:], strict=False)]
    median_gap = statistics.median(gaps) if gaps else 0.0
    out = []
    for start, end, _ in pushes:
        window = [
            b - a
            for r in results
            for a, b in zip(r["times"][1:], r["times"][2:], strict=False)
            if start <= b <= end + 0.5
        ]
        out.append((max(window) - median_gap) if window else 0.0)
    return median_gap, out


def dropped(results: list[dict]) -> int:
    return sum(1 for r in results if not r.get("done") or r.get("finish") not in ("stop", "length"))


def print_pushes(results: list[dict], pushes: list) -> None:
    median_gap, stalled = stalls(results, pushes)
    print(
        f"sessions dropped: {dropped(results)} in all, {dropped(results) / max(len(pushes), 1):.2f} per push"
    )
    for i, ((start, end, report), stall) in enumerate(zip(pushes, stalled, strict=True)):
        print(
            f"push {i + 1} ({report.mode}): {(end - start) * 1000:.0f} ms to serve the new version, "
            f"pause {report.pause_seconds * 1000:.0f} ms, stream stall {stall * 1000:.1f} ms"
        )
    print(f"median gap between chunks: {median_gap * 1000:.1f} ms")


def todays_vllm_push(gateway, engine_url: str, body: dict, sessions: int, pushed: Pushes) -> None:
    """Before issue 43 a vLLM push paused with `mode=wait`: one such push under the same sessions."""
    dialect = DIALECTS["vllm"]
    dialect.pause_mode = "wait"  # type: ignore[misc]
    try:
        pushes = Pushes(engine_url, pushed.checkpoints, 1.0, limit=1, checkpoint_of=pushed.checkpoint_of)
        results, done = run_sessions(gateway, engine_url, body, sessions, pushes)
    finally:
        del dialect.pause_mode  # type: ignore[misc]
    if done:
        start, end, report = done[0]
        print(
            f"today (mode=wait): the push took {(end - start) * 1000:.0f} ms, pause "
            f"{report.pause_seconds * 1000:.0f} ms (it waited for the longest call in flight); "
            f"sessions dropped {dropped(results)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--sampled", type=int, default=256)
    parser.add_argument("--token-delay", type=float, default=0.005, help="embedded engine only")
    parser.add_argument("--push-every", type=float, default=None, help="seconds (3 embedded, 1 vLLM)")
    args = parser.parse_args()
    every = args.push_every or (1.0 if args.engine == "vllm" else 3.0)
    root = Path(tempfile.mkdtemp(prefix="bench-inflight-"))
    engine_url, stop_engine, checkpoints = start_engine(
        args.engine, root, answer_text(args.sampled), args.token_delay
    )
    gateway = gateway_processes.start_gateway(
        engine_url, root / "flows", confdir=root / "conf", log=root / "gw.log"
    )
    body = {
        "model": "gpt-4.1",
        "stream": True,
        "max_tokens": args.sampled,
        "messages": [{"role": "user", "content": "hi"}],
    }
    try:
        pushes = Pushes(engine_url, checkpoints, every)
        results, done = run_sessions(gateway, engine_url, body, args.sessions, pushes)
        time.sleep(1.0)  # the last records reach the journal
        recorded = record_tokens_by_version(root / "flows")
        stats = {}
        if args.engine == "embedded":
            stats = httpx.get(
                f"{engine_url}/engine_stats", headers=engine_keys.auth_headers(engine_url), timeout=10
            ).json()
        print(
            f"{args.engine}: {args.sessions} sessions × {args.sampled} tokens, {len(done)} pushes every {every} s\n"
        )
        print_pushes(results, done)
        if args.engine == "vllm":
            todays_vllm_push(gateway, engine_url, body, args.sessions, pushes)
    finally:
        gateway.stop()
        stop_engine()
    print(f"tokens per version, records: {dict(sorted(recorded.items()))}")
    if args.engine == "embedded":
        engine_counts = dict(stats.get("tokens_by_version", {}))
        print(f"tokens per version, engine:  {dict(sorted(engine_counts.items()))}")
        print("equal" if dict(recorded) == engine_counts else "DIFFERENT")
    else:
        print("(vLLM's own account: the records' spans are its answers' weight_versions)")
    per_span, per_record, records, tokens = step0_logp_diff(root / "flows", pushes.checkpoint_of)
    print(
        f"step-0 logp_diff over the {tokens} sampled tokens of the {records} records a push split: "
        f"{per_span:.2e} scored per span's version, {per_record:.2e} scored by the record's one version "
        f"({per_record / max(per_span, 1e-12):.0f}x)"
    )


if __name__ == "__main__":
    main()
