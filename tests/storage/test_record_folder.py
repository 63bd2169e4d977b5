"""Issue 36, storage side, on a real RecordWriter and real folders: one writer per records folder (its flock), a
record is its `request_id` (a frame written twice is one record), and records are their owner's only (modes).

The gateway processes' side of the same (two gateways, a dead gateway's journal) is `test_gateway_folders.py`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from polar_mitm.storage.journal import LOCK_FILE, QUARANTINE_DIR, RecordFolderBusy, RecordWriter
from polar_mitm.storage.journal_format import JOURNAL_DIR, JOURNAL_SUFFIX, encode_frame
from polar_mitm.storage.records import Record, read_all


def record(i: int, session: str = "s") -> dict:
    now = datetime.now(UTC)
    return Record(
        request_id=f"{session}-r{i}",
        session_id=session,
        seq=i,
        started_at=now,
        finished_at=now,
        provider="openai_chat",
        path="/v1/chat/completions",
        stream=False,
        finish_reason="stop",
        prompt_ids=[1, 2, 3 + i],
        completion_ids=[7, 8],
        completion_logprobs=[-0.5, -0.25],
    ).to_journal()


def live_journal(folder: Path) -> Path:
    return next((folder / JOURNAL_DIR).glob(f"*{JOURNAL_SUFFIX}"))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- one writer per folder ----------------------------------------------------------------------------------------


def test_a_second_writer_on_a_live_folder_refuses_and_leaves_its_journal_alone(tmp_path):
    first = RecordWriter(tmp_path)
    first.start()
    for i in range(5):
        first.write(record(i)).result(timeout=10)
    journal = live_journal(tmp_path)
    with pytest.raises(RecordFolderBusy) as refused:
        RecordWriter(tmp_path).start()
    message = str(refused.value)
    assert "\n" not in message and str(tmp_path) in message and f"pid {os.getpid()}" in message, message
    assert journal.exists() and not list(tmp_path.glob("records-*.parquet"))  # not compacted under the writer
    first.write(record(5)).result(timeout=10)  # the first writer goes on appending to it
    first.close()
    assert sorted(read_all(tmp_path)["seq"].to_pylist()) == list(range(6))
    # Once the first is closed the folder is free: the next writer takes it and its records join the rest.
    second = RecordWriter(tmp_path)
    second.start()
    second.write(record(6)).result(timeout=10)
    second.close()
    assert sorted(read_all(tmp_path)["seq"].to_pylist()) == list(range(7))


# -- a record is its request_id ---------------------------------------------------------------------------------


def journal_with_a_frame_twice(folder: Path, second: Callable[[dict], dict]) -> Path:
    """A journal, as the gateway leaves it after kill -9, of three records whose second frame is followed by
    `second(that record)` (the same frame again, or another row under its id), framed by the writer's own code."""
    rows = [record(i) for i in range(3)]
    writer = RecordWriter(folder)
    writer.start()
    for row in rows:
        writer.write(row).result(timeout=10)
    journal = live_journal(folder)
    data = journal.read_bytes()
    writer.close()
    for shard in folder.glob("records-*.parquet"):
        shard.unlink()
    third = data.index(encode_frame(orjson.dumps(rows[2])))  # the writer's frame, byte for byte
    journal.write_bytes(data[:third] + encode_frame(orjson.dumps(second(rows[1]))) + data[third:])
    return journal


def test_a_frame_written_twice_is_one_record_live_and_after_compaction(tmp_path):
    journal_with_a_frame_twice(tmp_path, lambda row: row)
    assert sorted(read_all(tmp_path)["request_id"].to_pylist()) == ["s-r0", "s-r1", "s-r2"]
    writer = RecordWriter(tmp_path)  # the restarted gateway compacts the journal
    writer.start()
    writer.close()
    shards = list(tmp_path.glob("records-*.parquet"))
    assert len(shards) == 1
    assert sorted(pq.read_table(shards[0])["request_id"].to_pylist()) == ["s-r0", "s-r1", "s-r2"]
    assert not (tmp_path / QUARANTINE_DIR).exists()  # an exact copy is no damage: nothing set aside


def test_another_row_under_a_taken_request_id_is_set_aside_with_why(tmp_path):
    journal_with_a_frame_twice(tmp_path, lambda row: {**row, "completion_ids": [9, 9]})
    table = read_all(tmp_path)
    assert sorted(table["request_id"].to_pylist()) == ["s-r0", "s-r1", "s-r2"]
    assert [r["completion_ids"] for r in table.to_pylist() if r["request_id"] == "s-r1"] == [[7, 8]]
    writer = RecordWriter(tmp_path)
    writer.start()
    writer.close()
    (kept,) = (tmp_path / QUARANTINE_DIR).glob("*.rows.jsonl")
    (line,) = kept.read_text().splitlines()
    assert "request_id 's-r1' is taken" in orjson.loads(line)["reason"]
    assert orjson.loads(line)["row"]["completion_ids"] == [9, 9]


# -- records are their owner's only -----------------------------------------------------------------------------


def test_record_folders_journals_and_shards_are_created_owner_only(tmp_path):
    previous = os.umask(0o022)  # the usual umask: without explicit modes everything would be world-readable
    try:
        out = tmp_path / "run" / "flows"
        writer = RecordWriter(out)
        writer.start()
        writer.write(record(0)).result(timeout=10)
        journal_modes = {mode(j) for j in (out / JOURNAL_DIR).glob(f"*{JOURNAL_SUFFIX}")}
        writer.write({**record(1), "session_id": None}).result(timeout=10)  # cannot be a record: quarantined
        writer.close()
    finally:
        os.umask(previous)
    assert {mode(tmp_path / "run"), mode(out), mode(out / JOURNAL_DIR), mode(out / QUARANTINE_DIR)} == {0o700}
    assert journal_modes <= {0o600}
    files = [out / JOURNAL_DIR / LOCK_FILE, *out.glob("records-*.parquet"), *(out / QUARANTINE_DIR).iterdir()]
    assert len(files) >= 3 and {mode(f) for f in files} == {0o600}, {str(f): oct(mode(f)) for f in files}
