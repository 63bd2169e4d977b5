"""Benchmark `polar-mitm merge` on synthetic agent sessions with realistic, growing prompts.

    .venv/bin/python benchmarks/bench_merge.py                   # 100k requests, 8k–64k-token prompts
    .venv/bin/python benchmarks/bench_merge.py --requests 5000   # a quick run

What it generates: `--concurrency` harness sessions live at once, their records interleaved in arrival order
across Parquet shards (like the gateway's). A session's first prompt is 8k–12k tokens (system prompt + tools +
task); each turn samples 50–600 tokens, and the next prompt = previous prompt + the answer re-tokenised with a
little drift + a tool result (300–2500 tokens). When a prompt would pass `--max-prompt` the harness compacts
(a new, short history). Some sessions run an interleaved subagent; a few calls are retried, fail, or are cut
short (length); a few records arrive out of order.

What it measures, each step in its own process (so peak RSS is the step's own):
- baseline: plain Parquet read + write of the same shards (pyarrow defaults, as merge writes);
- merge: `polar-mitm merge --builder prefix_merging` with the invariants checked, as a ratio to the baseline;
- Polar's routing on the same data (one chain per session, cut at the first break, the rest dropped), for
  sequences/requests and what it loses;
- optionally (`--per-request`) the per_request builder.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polar_mitm.storage.records import RECORD_SCHEMA  # noqa: E402

IM_START, EOT, NL, SYSTEM, USER, ASSISTANT = 151644, 151645, 198, 8948, 872, 77091
VOCAB = 151_643  # ordinary tokens: ids below the specials
GEN = np.array([IM_START, ASSISTANT, NL], dtype=np.int32)
T0_US = 1_735_689_600_000_000  # 2025-01-01, in epoch microseconds


# -- synthetic sessions ------------------------------------------------------------------------------------------


class TokenSource:
    """Zipf-like token ids (text is not uniform over the vocabulary), drawn fast by inverse CDF."""

    def __init__(self, rng: np.random.Generator) -> None:
        weights = 1.0 / (np.arange(VOCAB) + 20.0)
        self.cdf = np.cumsum(weights) / weights.sum()
        self.ids = rng.permutation(VOCAB).astype(np.int32)
        self.rng = rng

    def draw(self, n: int) -> np.ndarray:
        return self.ids[np.minimum(np.searchsorted(self.cdf, self.rng.random(n)), VOCAB - 1)]


def message(role: int, content: np.ndarray) -> np.ndarray:
    return np.concatenate([[IM_START, role, NL], content, [EOT, NL]]).astype(np.int32)


class Agent:
    """One agent's history in an append-only buffer: every prompt is a view of its prefix (no copies)."""

    def __init__(self, capacity: int, system: np.ndarray, task: np.ndarray) -> None:
        self.capacity, self.system = capacity, system
        self.reset(task)

    def reset(self, first_user: np.ndarray) -> None:
        self.buf = np.empty(self.capacity, dtype=np.int32)
        self.n = 0
        self.append(message(SYSTEM, self.system))
        self.append(message(USER, first_user))

    def append(self, ids: np.ndarray) -> None:
        self.buf[self.n : self.n + len(ids)] = ids
        self.n += len(ids)


@dataclass
class SessionGen:
    """One session's records (dicts of numpy arrays) in seq order."""

    session_id: str
    tokens: TokenSource
    rng: np.random.Generator
    turns: int
    max_prompt: int
    subagent: bool
    records: list[dict] = field(default_factory=list)
    seq: int = 0

    def emit(self, prompt: np.ndarray, sampled: np.ndarray, finish: str) -> None:
        logprobs = -self.rng.exponential(0.4, len(sampled)).astype(np.float32)
        self.records.append(
            {
                "session_id": self.session_id,
                "request_id": f"{self.session_id}-{self.seq:04d}",
                "seq": self.seq,
                "prompt_ids": prompt,
                "completion_ids": sampled,
                "completion_logprobs": logprobs,
                "finish_reason": finish,
                "weight_version": str(self.seq // 16),
            }
        )
        self.seq += 1

    def sample(self) -> np.ndarray:
        return self.tokens.draw(int(self.rng.integers(50, 600)))

    def call(self, agent: Agent) -> None:
        agent.append(GEN)
        prompt = agent.buf[: agent.n]
        r = self.rng.random()
        if r < 0.01:  # an engine error: recorded, excluded, and the harness retries
            self.emit(prompt, np.zeros(0, np.int32), "error")
        elif r < 0.02:  # a sample the harness throws away (timeout, resample)
            self.emit(prompt, np.append(self.sample(), EOT).astype(np.int32), "stop")
        body = self.sample()
        truncated = self.rng.random() < 0.02
        sampled = body if truncated else np.append(body, EOT).astype(np.int32)
        self.emit(prompt, sampled, "length" if truncated else "tool_calls")
        # The answer as the template renders it: a few tokens re-tokenised differently.
        echo = body.copy()
        drift = self.rng.random(len(echo)) < 0.03
        echo[drift] = (echo[drift] + 1) % VOCAB
        agent.append(echo)
        agent.append(np.array([EOT, NL], dtype=np.int32))
        agent.append(message(USER, self.tokens.draw(int(self.rng.integers(300, 2500)))))
        if agent.n + 3000 > self.max_prompt:  # compaction: a summary replaces the history
            agent.reset(self.tokens.draw(2000))

    def generate(self) -> list[dict]:
        capacity = self.max_prompt + 4096
        main = Agent(capacity, self.tokens.draw(int(self.rng.integers(8000, 12000))), self.tokens.draw(200))
        sub = (
            Agent(capacity, self.tokens.draw(int(self.rng.integers(6000, 9000))), self.tokens.draw(200))
            if self.subagent
            else None
        )
        sub_turns = set(self.rng.choice(self.turns, size=min(self.turns, 8), replace=False)) if sub else set()
        for turn in range(self.turns):
            self.call(sub if sub is not None and turn in sub_turns else main)
        return self.records


def arrival_order(sessions: list[list[dict]], concurrency: int, rng: np.random.Generator):
    """Interleave sessions as a gateway sees them: `concurrency` live at once, a few records out of order."""
    waiting = list(range(len(sessions)))[::-1]
    live: list[tuple[int, int]] = []  # (session index, next record)
    while waiting or live:
        while waiting and len(live) < concurrency:
            live.append((waiting.pop(), 0))
        pick = int(rng.integers(len(live)))
        index, pos = live[pick]
        records = sessions[index]
        if pos + 1 < len(records) and rng.random() < 0.01:  # a slow call finishing after the next one
            yield records[pos + 1]
            yield records[pos]
            pos += 2
        else:
            yield records[pos]
            pos += 1
        if pos >= len(records):
            live.pop(pick)
        else:
            live[pick] = (index, pos)


def list_array(parts: list[np.ndarray], value_type: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(np.concatenate(parts), type=value_type)
    )


def write_shard(path: Path, rows: list[dict]) -> None:
    n = len(rows)
    ts = pa.array([T0_US + 1000 * r["seq"] for r in rows], pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    columns = {
        "schema_version": pa.array([1] * n, pa.int16()),
        "request_id": pa.array([r["request_id"] for r in rows]),
        "session_id": pa.array([r["session_id"] for r in rows]),
        "task_id": pa.array([f"task-{int(r['session_id'].split('-')[1]) % 50}" for r in rows]),
        "seq": pa.array([r["seq"] for r in rows], pa.int64()),
        "started_at": ts,
        "finished_at": ts,
        "provider": pa.array(["openai_chat"] * n),
        "path": pa.array(["/v1/chat/completions"] * n),
        "stream": pa.array([True] * n),
        "prompt_ids": list_array([r["prompt_ids"] for r in rows], pa.int32()),
        "completion_ids": list_array([r["completion_ids"] for r in rows], pa.int32()),
        "completion_logprobs": list_array([r["completion_logprobs"] for r in rows], pa.float32()),
        "finish_reason": pa.array([r["finish_reason"] for r in rows]),
        "weight_version": pa.array([r["weight_version"] for r in rows]),
    }
    arrays = [columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in RECORD_SCHEMA]
    pq.write_table(pa.Table.from_arrays(arrays, schema=RECORD_SCHEMA), path)


def generate(
    out: Path, requests: int, *, max_prompt: int, concurrency: int, seed: int, rows_per_shard: int
) -> dict:
    """Write about `requests` records as shards under `out`; return size figures."""
    rng = np.random.default_rng(seed)
    tokens = TokenSource(rng)
    out.mkdir(parents=True, exist_ok=True)
    made, prompt_tokens, shard, buffered = 0, 0, 0, []
    # Generate sessions lazily, `concurrency` batches at a time, so memory stays bounded at any size.
    session_number = 0
    while made < requests:
        batch = []
        for _ in range(concurrency * 2):
            if made >= requests:
                break
            gen = SessionGen(
                session_id=f"sess-{session_number:06d}",
                tokens=tokens,
                rng=rng,
                turns=int(rng.integers(20, 60)),
                max_prompt=max_prompt,
                subagent=rng.random() < 0.3,
            )
            records = gen.generate()[: requests - made]
            made += len(records)
            session_number += 1
            batch.append(records)
        for record in arrival_order(batch, concurrency, rng):
            buffered.append(record)
            prompt_tokens += len(record["prompt_ids"])
            if len(buffered) == rows_per_shard:
                write_shard(out / f"records-{shard:05d}.parquet", buffered)
                shard, buffered = shard + 1, []
    if buffered:
        write_shard(out / f"records-{shard:05d}.parquet", buffered)
        shard += 1
    size = sum(p.stat().st_size for p in out.glob("*.parquet"))
    return {
        "requests": made,
        "sessions": session_number,
        "prompt_tokens": prompt_tokens,
        "shards": shard,
        "bytes": size,
    }


# -- the measured steps (each in a child process) ----------------------------------------------------------------


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_baseline(flows: str, out: str) -> dict:
    started = time.perf_counter()
    Path(out).mkdir(parents=True, exist_ok=True)
    for shard in sorted(Path(flows).glob("*.parquet")):
        pq.write_table(pq.read_table(shard), Path(out) / shard.name)
    return {"seconds": time.perf_counter() - started, "peak_rss_mb": peak_rss_mb()}


def build_polar(turns, *, eot_token_id):
    """Polar's prefix_merging as a builder: one chain per session, cut at the first break, the rest dropped."""
    from polar_mitm.reconstruct.prefix_merging import assemble, polar_routing, splice_point
    from polar_mitm.reconstruct.turns import BuildResult

    routing = polar_routing(turns, eot_token_id=eot_token_id)
    chain = turns[: len(routing.chain)]
    contexts = [chain[0].prompt_ids]
    for before, turn in zip(chain, chain[1:], strict=False):
        closed = int(before.completion_ids[-1]) == eot_token_id
        contexts.append(
            turn.prompt_ids[splice_point(turn.prompt_ids, len(before.prompt_ids), closed, eot_token_id) :]
        )
    dropped_tokens = sum(len(t.completion_ids) for t in turns[len(chain) :])
    return BuildResult(
        sequences=[assemble(chain, contexts, builder="polar")],
        breaks=Counter(
            {"dropped requests": len(routing.dropped), "dropped trainable tokens": dropped_tokens}
        ),
    )


def step_merge(flows: str, out: str, builder: str, check: bool) -> dict:
    from polar_mitm.reconstruct.merge import BUILDERS, merge

    BUILDERS.setdefault("polar", build_polar)
    started = time.perf_counter()
    summary = merge([flows], out, builder=builder, eot_token=str(EOT), check=check)
    return {
        "seconds": time.perf_counter() - started,
        "peak_rss_mb": peak_rss_mb(),
        "summary": summary.to_json(),
    }


def in_child(function, *args):
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


# -- main --------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000, help="records to generate (default 100k)")
    parser.add_argument("--max-prompt", type=int, default=65_536, help="compaction threshold in tokens")
    parser.add_argument("--concurrency", type=int, default=32, help="sessions live at once (interleaving)")
    parser.add_argument("--rows-per-shard", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="default: a temporary folder, removed after"
    )
    parser.add_argument("--per-request", action="store_true", help="also time the per_request builder")
    parser.add_argument("--no-check", action="store_true", help="merge without the invariant checks")
    args = parser.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-merge-"))
    flows = workdir / "flows"
    try:
        started = time.perf_counter()
        data = generate(
            flows,
            args.requests,
            max_prompt=args.max_prompt,
            concurrency=args.concurrency,
            seed=args.seed,
            rows_per_shard=args.rows_per_shard,
        )
        generated = time.perf_counter() - started
        print(
            f"generated {data['requests']:,} requests in {data['sessions']:,} sessions, "
            f"{data['prompt_tokens']:,} prompt tokens "
            f"(mean {data['prompt_tokens'] / data['requests']:,.0f}/request), {data['shards']} shards, "
            f"{data['bytes'] / 2**30:.2f} GiB Parquet, in {generated:.1f} s",
            flush=True,
        )

        baseline = in_child(step_baseline, str(flows), str(workdir / "copy"))
        shutil.rmtree(workdir / "copy", ignore_errors=True)
        print(
            f"baseline read+write: {baseline['seconds']:.1f} s, peak RSS {baseline['peak_rss_mb']:,.0f} MB",
            flush=True,
        )
        runs = {
            "prefix_merging": in_child(
                step_merge, str(flows), str(workdir / "merged"), "prefix_merging", not args.no_check
            )
        }
        runs["polar"] = in_child(step_merge, str(flows), str(workdir / "polar"), "polar", False)
        if args.per_request:
            runs["per_request"] = in_child(
                step_merge, str(flows), str(workdir / "per_request"), "per_request", not args.no_check
            )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(
        f"{'':<26}{'seconds':>9}{'× baseline':>12}{'Mtok/s':>9}{'peak RSS MB':>13}"
        f"{'sequences':>11}{'req/seq':>9}{'dropped req':>13}{'trainable tok':>15}"
    )
    print(
        f"{'parquet read+write':<26}{baseline['seconds']:>9.1f}{1.0:>12.2f}"
        f"{data['prompt_tokens'] / 1e6 / baseline['seconds']:>9.0f}{baseline['peak_rss_mb']:>13,.0f}"
    )
    for name, run in runs.items():
        s = run["summary"]
        dropped = s["breaks"].get("dropped requests", 0)
        kept_requests = s["trainable_records"] - dropped
        trainable = s["trainable_tokens"]
        label = {
            "prefix_merging": "merge prefix_merging" + ("" if args.no_check else " +check"),
            "polar": "Polar routing (reference)",
            "per_request": "merge per_request",
        }[name]
        print(
            f"{label:<26}{run['seconds']:>9.1f}{run['seconds'] / baseline['seconds']:>12.2f}"
            f"{data['prompt_tokens'] / 1e6 / run['seconds']:>9.0f}{run['peak_rss_mb']:>13,.0f}"
            f"{s['sequences']:>11,}{kept_requests / max(1, s['sequences']):>9.2f}{dropped:>13,}{trainable:>15,}"
        )
    ours, polar = runs["prefix_merging"]["summary"], runs["polar"]["summary"]
    lost = polar["breaks"].get("dropped trainable tokens", 0)
    print()
    print(
        f"prefix_merging: {ours['trainable_records']:,} requests → {ours['sequences']:,} sequences "
        f"(sequences/requests {ours['sequences'] / ours['trainable_records']:.4f}), nothing dropped; "
        f"breaks: {ours['breaks']}; excluded: {ours['excluded']}"
    )
    print(
        f"Polar routing:  {polar['trainable_records'] - polar['breaks'].get('dropped requests', 0):,} requests "
        f"kept → {polar['sequences']:,} sequences (sequences/requests "
        f"{polar['sequences'] / max(1, polar['trainable_records']):.4f} of all requests), "
        f"{polar['breaks'].get('dropped requests', 0):,} requests and {lost:,} trainable tokens dropped "
        f"({100 * lost / max(1, lost + polar['trainable_tokens']):.1f}% of trainable tokens)"
    )


if __name__ == "__main__":
    main()
