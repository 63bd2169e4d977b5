"""Durable record writing: an fsynced append-only journal, compacted into Parquet shards.

Why a journal: Parquet files are only readable once closed, but a record must survive `kill -9` as soon as the
harness has its answer. So each record is first appended as a checksummed frame to `<out>/_journal/*.polarj` and
fsynced (group commit: one fsync covers every record queued meanwhile) *before* the gateway answers the harness.
At rotation (size or age), shutdown and the next start, journals are compacted into `<out>/records-*.parquet`
(temp file + fsync + rename), so a shard is never left half-written. Readers ignore `_journal/` (pyarrow skips
names starting with `_`).

All file work happens on one writer thread; the event loop only enqueues and awaits a future.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq

from polar_mitm.records import journal_rows_to_table

log = logging.getLogger("polar_mitm.journal")

FRAME_HEADER = struct.Struct("<II")  # payload length, crc32
JOURNAL_DIR = "_journal"
JOURNAL_SUFFIX = ".polarj"


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Every intact frame of a journal; a torn or corrupt tail (a crash mid-write) ends the read."""
    rows: list[dict[str, Any]] = []
    data = path.read_bytes()
    pos = 0
    while pos + FRAME_HEADER.size <= len(data):
        length, crc = FRAME_HEADER.unpack_from(data, pos)
        start, end = pos + FRAME_HEADER.size, pos + FRAME_HEADER.size + length
        if end > len(data) or zlib.crc32(data[start:end]) != crc:
            log.warning("journal %s: ignoring a torn tail at byte %d (never acknowledged)", path.name, pos)
            break
        rows.append(orjson.loads(data[start:end]))
        pos = end
    return rows


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def compact_journal(journal: Path, out_dir: Path) -> Path | None:
    """Write the journal's records as one Parquet shard (atomically), then delete the journal."""
    rows = read_journal(journal)
    shard = None
    if rows:
        table = journal_rows_to_table(rows)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(rows[0]["started_at"] / 1e6))
        shard = out_dir / f"records-{stamp}-{journal.stem.split('-')[-1]}.parquet"
        tmp = out_dir / f".{shard.name}.tmp"
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, shard)
        fsync_dir(out_dir)
    journal.unlink()
    fsync_dir(journal.parent)
    return shard


class RecordWriter:
    """Appends records durably; `write()` returns a Future that resolves once the record is on disk."""

    def __init__(self, out_dir: str | Path, *, rotate_bytes: int = 64 << 20, rotate_seconds: float = 300.0,
                 fsync: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.journal_dir = self.out_dir / JOURNAL_DIR
        self.rotate_bytes, self.rotate_seconds, self.fsync = rotate_bytes, rotate_seconds, fsync
        self._queue: queue.Queue[tuple[bytes, Future] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._file = None
        self._journal: Path | None = None
        self._opened_at = 0.0
        self._size = 0
        self.shards_written: list[Path] = []

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Recover journals a crash left behind, then start the writer thread."""
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        for leftover in sorted(self.journal_dir.glob(f"*{JOURNAL_SUFFIX}")):
            shard = compact_journal(leftover, self.out_dir)
            log.info("recovered journal %s → %s", leftover.name, shard)
        self._thread = threading.Thread(target=self._run, name="polar-record-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Flush everything queued and compact the open journal into a shard."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join()
        self._thread = None

    # -- API -----------------------------------------------------------------------------------------------------

    def write(self, row: dict[str, Any]) -> Future:
        """Queue one record (a journal dict); the Future resolves when it is durable."""
        fut: Future = Future()
        payload = orjson.dumps(row)
        self._queue.put((FRAME_HEADER.pack(len(payload), zlib.crc32(payload)) + payload, fut))
        return fut

    # -- writer thread -------------------------------------------------------------------------------------------

    def _open(self) -> None:
        name = f"journal-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:12]}{JOURNAL_SUFFIX}"
        self._journal = self.journal_dir / name
        self._file = open(self._journal, "ab")
        fsync_dir(self.journal_dir)
        self._opened_at, self._size = time.monotonic(), 0

    def _rotate(self) -> None:
        if self._file is None or self._journal is None:
            return
        self._file.close()
        self._file = None
        try:
            shard = compact_journal(self._journal, self.out_dir)
            if shard:
                self.shards_written.append(shard)
        except Exception:  # the journal stays on disk and is compacted at the next start
            log.exception("compaction of %s failed; it will be retried at the next start", self._journal)
        self._journal = None

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                first = self._queue.get(timeout=1.0)
            except queue.Empty:
                if self._file is not None and time.monotonic() - self._opened_at > self.rotate_seconds:
                    self._rotate()
                continue
            batch = [first]
            while True:  # group commit: everything queued so far shares one fsync
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items = [b for b in batch if b is not None]
            stopping = len(items) != len(batch)
            if items:
                self._append(items)
            if self._file is not None and (stopping or self._size >= self.rotate_bytes
                                           or time.monotonic() - self._opened_at > self.rotate_seconds):
                self._rotate()

    def _append(self, items: list[tuple[bytes, Future]]) -> None:
        try:
            if self._file is None:
                self._open()
            assert self._file is not None
            self._file.write(b"".join(frame for frame, _ in items))
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
            self._size += sum(len(frame) for frame, _ in items)
        except Exception as exc:
            for _, fut in items:
                fut.set_exception(exc)
            return
        for _, fut in items:
            fut.set_result(None)
