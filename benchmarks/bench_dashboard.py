"""Benchmark the dashboard's paged queries on a large run: 100k model calls open in ≤ 1 s.

    .venv/bin/python benchmarks/bench_dashboard.py                    # 100k calls, 10 per session
    .venv/bin/python benchmarks/bench_dashboard.py --calls 10000      # a quick run

What it generates: one iteration folder (RUN/iter-0) whose records are written by the gateway's own writer
(`storage/journal.RecordWriter`: the journal, compacted into Parquet shards), `--calls-per-session` calls per
session with prompts of `--prompt-tokens` ids and a sampled answer, the request and answer JSON as a harness sends
them; and its rewards.parquet. Then, through the app itself (Starlette's test client, the same routes the page
calls):

- baseline: a plain pyarrow read of the record shards (every column), and of the small columns the table uses;
- first page: GET /api/sessions on a cold server (the per-session table built), as a ratio to the baseline;
- next pages: the same sorted by reward, filtered by task, paged deep (the table kept);
- a session: GET /api/session/ID (its calls' rows read with a filter, tokens shown as ids: no tokenizer here);
- a text search over every prompt and answer (the slow path, on demand).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polar_mitm.storage.journal import RecordWriter  # noqa: E402
from polar_mitm.storage.records import Record  # noqa: E402
from polar_mitm.storage.rewards import RewardRow, rewards_table, write_rewards_table  # noqa: E402

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TASKS = 50


def write_run(run_dir: Path, calls: int, per_session: int, prompt_tokens: int) -> None:
    """RUN/iter-0 with `calls` records (through RecordWriter) and a reward per session."""
    rng = np.random.default_rng(0)
    flows = run_dir / "iter-0" / "flows"
    writer = RecordWriter(flows, fsync=False, compact_in_child=False)
    writer.start()
    sessions = calls // per_session
    rewards = []
    pending = []
    for s in range(sessions):
        session_id, task_id = f"task-{s % TASKS}-{s}", f"task-{s % TASKS}"
        start = T0 + timedelta(seconds=s * 0.5)
        for seq in range(per_session):
            prompt = rng.integers(0, 150_000, prompt_tokens + 20 * seq, dtype=np.int32).tolist()
            completion = rng.integers(0, 150_000, 40, dtype=np.int32).tolist()
            text = f"session {s} turn {seq}: fix the failing test in module_{s % 97}.py"
            record = Record(
                request_id=f"req-{s}-{seq}",
                session_id=session_id,
                task_id=task_id,
                seq=seq,
                started_at=start + timedelta(seconds=2 * seq),
                finished_at=start + timedelta(seconds=2 * seq + 1.5),
                provider="openai_chat",
                path="/v1/chat/completions",
                stream=True,
                finish_reason="stop" if seq == per_session - 1 else "tool_calls",
                request_json=f'{{"messages":[{{"role":"user","content":"{text}"}}]}}',
                messages_json=f'[{{"role":"user","content":"{text}"}}]',
                response_json='{"choices":[{"message":{"content":"done"}}]}',
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=rng.uniform(-3, 0, len(completion)).astype(np.float32).tolist(),
                weight_version=str(seq // 4),
                prompt_tokens=len(prompt),
                completion_tokens=len(completion),
            )
            pending.append(writer.write(record.to_journal()))
        rewards.append(
            RewardRow(
                session_id=session_id,
                task_id=task_id,
                sample_index=s // TASKS,
                reward=float(s % 3 == 0),
                status="ok",
                end="completed",
                exit_code=0,
                init_seconds=0.1,
                run_seconds=5.0,
                eval_seconds=0.2,
                eval_output="",
            )
        )
        if len(pending) > 5000:
            for future in pending:
                future.result()
            pending.clear()
    for future in pending:
        future.result()
    writer.close()
    write_rewards_table(rewards_table(rewards), run_dir / "iter-0" / "rewards.parquet")


def timed(action) -> tuple[float, object]:
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--calls-per-session", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument(
        "--keep", type=Path, help="write the run here and keep it (default: a temporary folder)"
    )
    args = parser.parse_args()
    run_dir = args.keep or Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    try:
        seconds, _ = timed(lambda: write_run(run_dir, args.calls, args.calls_per_session, args.prompt_tokens))
        shards = sorted((run_dir / "iter-0" / "flows").glob("*.parquet"))
        size = sum(p.stat().st_size for p in shards) / 1e6
        print(
            f"wrote {args.calls} calls in {len(shards)} shards ({size:.0f} MB) with RecordWriter in {seconds:.1f}s"
        )

        from starlette.testclient import TestClient

        from polar_mitm.dashboard.routes import dashboard_app

        small = [
            "session_id",
            "task_id",
            "seq",
            "started_at",
            "finished_at",
            "finish_reason",
            "weight_version",
        ]
        full, _ = timed(lambda: [pq.read_table(p) for p in shards])
        narrow, _ = timed(lambda: [pq.read_table(p, columns=small) for p in shards])
        print(f"baseline: pyarrow read, every column {full:.3f}s; the small columns {narrow:.3f}s")
        client = TestClient(dashboard_app(run_dir))

        def page(query: str) -> float:
            took, response = timed(lambda: client.get(f"/api/sessions?{query}"))
            assert response.status_code == 200, response.text
            return took

        first = page("limit=50")
        print(f"first page (cold: per-session table built): {first:.3f}s = {first / full:.2f}x the full read, "
              f"{first / narrow:.2f}x the small-column read  [{'ok' if first <= 1.0 else 'OVER'} ≤ 1 s]")  # fmt: skip
        for label, query in (
            ("next page", "limit=50&offset=50"),
            ("sorted by reward", "limit=50&sort=reward&desc=1"),
            ("filtered by task", "limit=50&task_id=task-7"),
            ("deep page", f"limit=50&offset={args.calls // args.calls_per_session - 50}"),
        ):
            took = page(query)
            print(f"{label}: {took:.3f}s = {took / full:.2f}x the full read")
        took, response = timed(lambda: client.get("/api/session/task-7-7"))
        assert response.status_code == 200 and len(response.json()["calls"]) == args.calls_per_session
        print(
            f"a session ({args.calls_per_session} calls, tokens): {took:.3f}s = {took / full:.2f}x the full read"
        )
        search, response = timed(lambda: client.get("/api/sessions?limit=50&q=module_42.py"))
        found = response.json()["total"]
        assert found == len(range(42, args.calls // args.calls_per_session, 97)), found
        print(f"text search over every prompt and answer ({found} sessions): {search:.3f}s = "
              f"{search / full:.2f}x the full read")  # fmt: skip
    finally:
        if args.keep is None:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
