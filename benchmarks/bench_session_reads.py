"""Reading each session's records as it ends, from a journal that grows: what the rollout service does.

A live journal (the gateway's framed format) gains one session at a time, `--calls` calls of `--prompt-tokens`
prompt ids each; after each session is appended it is read back, once with `records.read_session` (the whole
folder, each time: what the service did) and once with `session_records.SessionRecords` (what was appended since,
and the session's own frames: what it does now). Both must return the same table. Printed: the time per session
read both ways at the journal's end, in all, and the ratio, for a journal growing to `--sessions` sessions (the
gateway rotates its journal at 64 MB: the default ends near that).

    .venv/bin/python benchmarks/bench_session_reads.py [--sessions 200] [--calls 10] [--prompt-tokens 2000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import orjson

from polar_mitm.storage.journal_format import FILE_HEADER, JOURNAL_DIR, encode_frame
from polar_mitm.storage.records import Record, read_session
from polar_mitm.storage.session_records import SessionRecords


def frames(session: str, calls: int, prompt_tokens: int) -> bytes:
    """A session's calls as journal frames: each prompt the last one plus ~100 tokens, 100 sampled."""
    out = bytearray()
    for seq in range(calls):
        now = datetime.now(UTC)
        n = prompt_tokens + 100 * seq
        row = Record(
            request_id=str(uuid.uuid4()),
            session_id=session,
            seq=seq,
            started_at=now,
            finished_at=now,
            provider="openai_chat",
            path="/v1/chat/completions",
            stream=False,
            finish_reason="stop",
            prompt_ids=list(range(n)),
            completion_ids=list(range(100)),
            completion_logprobs=[-0.5] * 100,
            messages_json="x" * (4 * n),
            request_json="y" * (4 * n),
        ).to_journal()
        out += encode_frame(orjson.dumps(row))
    return bytes(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        journal = folder / JOURNAL_DIR / "journal-20260101T000000-bench.polarj"
        journal.parent.mkdir()
        journal.write_bytes(FILE_HEADER)
        reader = SessionRecords(folder)
        whole = followed = 0.0
        last_whole = last_followed = 0.0
        for k in range(args.sessions):
            session = f"session-{k}"
            with journal.open("ab") as out:
                out.write(frames(session, args.calls, args.prompt_tokens))
            started = time.perf_counter()
            a = read_session(folder, session)
            last_whole = time.perf_counter() - started
            started = time.perf_counter()
            b = reader.read(session)
            last_followed = time.perf_counter() - started
            assert a.equals(b) and a.num_rows == args.calls, f"session {k}: the two reads differ"
            whole, followed = whole + last_whole, followed + last_followed
        size = journal.stat().st_size / 1e6
    print(
        f"{args.sessions} sessions of {args.calls} calls ({args.prompt_tokens}+ prompt tokens), each read as it "
        f"ends; the journal grows to {size:.0f} MB"
    )
    print(f"{'':34}{'read_session':>14}{'SessionRecords':>16}{'ratio':>8}")
    print(
        f"{'the last session (ms)':34}{last_whole * 1e3:14.1f}{last_followed * 1e3:16.1f}"
        f"{last_whole / last_followed:8.0f}×"
    )
    print(f"{'all sessions (s)':34}{whole:14.2f}{followed:16.2f}{whole / followed:8.0f}×")
    print(f"{'per session (ms)':34}{whole / args.sessions * 1e3:14.1f}{followed / args.sessions * 1e3:16.1f}")


if __name__ == "__main__":
    main()
