"""`SessionRecords` (storage/session_records.py): a session's records from a folder that keeps growing, read at the
cost of what was appended — always what `read_session` reads whole: every acknowledged row once, while a real
RecordWriter appends, rotates and compacts its journals underneath, and through torn, damaged and legacy journals."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.storage.journal import RecordWriter
from polar_mitm.storage.journal_format import FILE_HEADER, JOURNAL_DIR, encode_frame
from polar_mitm.storage.records import read_session
from polar_mitm.storage.session_records import SessionRecords, read_live_session
from tests.storage.test_journal_recovery import legacy_journal, record, write_shard


def ids(table: pa.Table) -> list[str]:
    return table["request_id"].to_pylist()


def same_as_read_session(reader: SessionRecords, folder: Path, session: str) -> pa.Table:
    got, whole = reader.read(session), read_session(folder, session)
    assert got.equals(whole), (ids(got), ids(whole))
    return got


def test_sessions_read_as_a_writer_appends_rotates_and_compacts_underneath(tmp_path):
    """Small journals (rotated every 32 KB, ~100 rows, compacted in the background) and reads all along: each read holds every
    row acknowledged before it began, once, and never a row of another session."""
    folder = tmp_path / "flows"
    writer = RecordWriter(folder, rotate_bytes=32768, rotate_seconds=0.2)
    writer.start()
    reader, sessions = SessionRecords(folder), [f"s{k}" for k in range(4)]
    acked: dict[str, set[str]] = {s: set() for s in sessions}
    lock, stop = threading.Lock(), threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            session = sessions[i % len(sessions)]
            row = record(i, session)
            writer.write(row).result()
            with lock:
                acked[session].add(row["request_id"])
            i += 1

    thread = threading.Thread(target=write)
    thread.start()
    reads = 0
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            for session in sessions:
                with lock:
                    before = set(acked[session])
                got = ids(reader.read(session))
                assert len(got) == len(set(got)), "a row read twice"
                assert before <= set(got), f"acknowledged rows missing: {sorted(before - set(got))[:3]}"
                assert all(r.startswith(f"{session}-") for r in got)
                reads += 1
    finally:
        stop.set()
        thread.join()
        writer.close()
    shards = list(folder.glob("records-*.parquet"))
    assert reads >= 10 and len(shards) > 3  # reads all along, across compactions
    for session in sessions:  # everything compacted now: the same rows as a whole read
        assert set(ids(same_as_read_session(reader, folder, session))) == acked[session]


def test_a_frame_still_being_written_is_read_once_it_is_whole(tmp_path):
    folder = tmp_path / "flows"
    journal = folder / JOURNAL_DIR / "journal-x-aaa.polarj"
    journal.parent.mkdir(parents=True)
    frames = [encode_frame(orjson.dumps(record(i))) for i in range(3)]
    journal.write_bytes(FILE_HEADER + frames[0] + frames[1][:20])
    reader = SessionRecords(folder)
    assert ids(same_as_read_session(reader, folder, "s")) == ["s-r0"]
    with journal.open("ab") as out:
        out.write(frames[1][20:] + frames[2][:5])
    assert ids(same_as_read_session(reader, folder, "s")) == ["s-r0", "s-r1"]
    with journal.open("ab") as out:
        out.write(frames[2][5:])
    assert ids(same_as_read_session(reader, folder, "s")) == ["s-r0", "s-r1", "s-r2"]


def test_damaged_legacy_shard_and_foreign_files_read_as_read_session_reads_them(tmp_path):
    """Garbage between frames (skipped, the frames after it read), a legacy journal, a gw-K folder, a shard, a
    Parquet file that is not records, and a row whose session_id is not at its head."""
    folder = tmp_path / "flows"
    journal = folder / JOURNAL_DIR / "journal-x-bbb.polarj"
    journal.parent.mkdir(parents=True)
    tail_first = {k: v for k, v in reversed(record(9, "a", request_json="y" * 2000).items())}
    rows = [record(0, "a"), record(1, "b"), record(2, "a"), tail_first]
    frames = [encode_frame(orjson.dumps(r)) for r in rows]
    journal.write_bytes(FILE_HEADER + frames[0] + b"\x00garbage\xff" * 3 + frames[1] + frames[2] + frames[3])
    legacy_journal(folder / "gw-1" / JOURNAL_DIR / "journal-y-ccc.polarj", [orjson.dumps(record(3, "a"))])
    write_shard(folder / "gw-1" / "records-20260101T000000-ddd.parquet", [record(4, "a"), record(5, "b")])
    pq.write_table(pa.table({"x": [1]}), folder / "other.parquet")
    reader = SessionRecords(folder)
    assert set(ids(same_as_read_session(reader, folder, "a"))) == {"a-r0", "a-r2", "a-r9", "a-r3", "a-r4"}
    assert set(ids(same_as_read_session(reader, folder, "b"))) == {"b-r1", "b-r5"}
    assert same_as_read_session(reader, folder, "nobody").num_rows == 0
    assert read_live_session(tmp_path / "missing", "a").num_rows == 0
