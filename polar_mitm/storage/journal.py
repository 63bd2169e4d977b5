"""Durable record writing: an fsynced append-only journal, compacted into Parquet shards.

Why a journal: Parquet files are only readable once closed, but a record must survive `kill -9` as soon as the
harness has its answer. So each record is first appended as a checksummed frame to `<out>/_journal/*.polarj` and
fsynced (group commit: one fsync covers every record queued meanwhile) *before* the gateway answers the harness.
At rotation (size or age), shutdown and the next start, journals are compacted into `<out>/records-*.parquet`
(temp file + fsync + rename), so a shard is never left half-written. Readers ignore `_journal/` (pyarrow skips
names starting with `_`).

No acknowledged record may be lost to one bad frame, so:

- every frame starts with a sync marker, and recovery resynchronises on the next intact frame after a corrupt
  region (journals written before the marker existed are read too: they have no file header);
- after a failed write the writer never appends to that journal again (its tail may hold a partial frame): the
  next record opens a new journal;
- a journal is deleted only when every byte of it became a record; otherwise it moves to `<out>/_quarantine/`
  with a `.reason` file giving the byte offsets, and rows that cannot be shard rows (checked strictly against the
  record schema: a null `session_id` would otherwise fail the shard write, every time) go to a `.rows.jsonl` there;
- a compaction that fails (a full disk) never stops the gateway, at startup either: the journal stays, and is
  compacted again at the next rotation or `rotate_seconds` later, whichever comes first. Nothing here logs at
  ERROR level while starting, since mitmproxy exits on an error logged during startup.

A shard is named after its journal (`records-<time>-<journal id>.parquet`) and appears before its journal goes, so
a reader that reads the journals first and the shards second, skipping journals whose shard exists, never misses
nor doubles a record (`read_live_journals`, `LiveJournals.uncompacted`; `storage/records.py` reads in that order).

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
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.records import RECORD_SCHEMA, journal_rows_to_table
from polar_mitm.storage.location import one_line

log = logging.getLogger("polar_mitm.journal")

FILE_HEADER = b"POLARJ2\n"  # starts every journal in the framed format; journals without it are legacy
FRAME_MAGIC = b"\xf0PJ\x1e"  # starts every frame: what recovery searches for after a corrupt region
FRAME_HEADER = struct.Struct("<II")  # payload length, crc32 of the payload (the whole frame header in legacy)
JOURNAL_DIR = "_journal"
JOURNAL_SUFFIX = ".polarj"
QUARANTINE_DIR = "_quarantine"
SHARD_GLOB = "records-*.parquet"


def encode_frame(payload: bytes) -> bytes:
    """One journal frame: sync marker, length, crc32, payload."""
    return FRAME_MAGIC + FRAME_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


# -- reading -----------------------------------------------------------------------------------------------------


@dataclass
class JournalScan:
    """What a journal holds: its records, and the byte ranges that did not read as records (with why)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    damaged: list[tuple[int, int, str]] = field(default_factory=list)

    def describe_damage(self) -> str:
        return "; ".join(f"bytes {start}–{end}: {why}" for start, end, why in self.damaged)


class _Frames:
    """Frame parsing for one journal's bytes, in the current (marked) or the legacy (unmarked) format."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.marked = data.startswith(FILE_HEADER)
        self.prefix = FRAME_MAGIC if self.marked else b""
        self.first = len(FILE_HEADER) if self.marked else 0

    def frame_at(self, pos: int) -> tuple[int, bytes] | str:
        """(end, payload) of an intact frame at `pos`, or why there is none."""
        data, start = self.data, pos + len(self.prefix) + FRAME_HEADER.size
        if start > len(data):
            return "a torn frame header at the end (a write that failed or was cut; never acknowledged)"
        if data[pos:pos + len(self.prefix)] != self.prefix:
            return "no frame marker (corrupt bytes)"
        length, crc = FRAME_HEADER.unpack_from(data, pos + len(self.prefix))
        if start + length > len(data):
            return "a frame cut at the end of the file (or a corrupt length)"
        payload = data[start:start + length]
        if zlib.crc32(payload) != crc:
            return "checksum mismatch (corrupt bytes)"
        return start + length, payload

    def next_frame(self, pos: int) -> int:
        """Where the next intact frame after `pos` starts (the end of the data if none does)."""
        data = self.data
        # Marked frames: search for the marker. Legacy ones: a payload is a JSON object, so try each `{`.
        needle, back = (FRAME_MAGIC, 0) if self.marked else (b"{", FRAME_HEADER.size)
        at = data.find(needle, pos + 1 + back)
        while at != -1:
            if at - back > pos and not isinstance(self.frame_at(at - back), str):
                return at - back
            at = data.find(needle, at + 1)
        return len(data)


def scan_bytes(data: bytes) -> JournalScan:
    """Every record in a journal's bytes, resynchronising after each corrupt region."""
    frames, scan = _Frames(data), JournalScan()
    if not frames.marked and FILE_HEADER.startswith(data):
        return scan  # empty, or cut while its header was written
    pos = frames.first
    while pos < len(data):
        found = frames.frame_at(pos)
        if isinstance(found, str):
            after = frames.next_frame(pos)
            scan.damaged.append((pos, after, found))
            pos = after
            continue
        end, payload = found
        try:
            row = orjson.loads(payload)
        except orjson.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            scan.rows.append(row)
        else:
            scan.damaged.append((pos, end, "a checksummed frame that is not a record (not a JSON object)"))
        pos = end
    return scan


def scan_journal(path: Path) -> JournalScan:
    """Every record of the journal at `path`; raises OSError if it cannot be read (gone, a folder, …)."""
    return scan_bytes(path.read_bytes())


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Every intact record of a journal (corrupt regions and a torn tail are skipped)."""
    return scan_journal(path).rows


def journal_id(path: Path) -> str:
    """What names a journal's shard: the last `-` part of its name (a random hex id for gateway journals)."""
    return path.stem.rsplit("-", 1)[-1]


def records_table(rows: list[dict[str, Any]]) -> tuple[pa.Table, list[tuple[dict[str, Any], str]]]:
    """Journal dicts → (a RECORD_SCHEMA table of the good rows, the rows that cannot be records with why).

    One bad row (a token id beyond int32, a missing field, a string where a number goes) must not keep the
    others out of a shard, so on failure each row is converted alone to find the bad ones.
    """
    try:
        return journal_rows_to_table(rows), []
    except Exception:  # which row, and why, is found below
        pass
    good: list[pa.Table] = []
    rejected: list[tuple[dict[str, Any], str]] = []
    for row in rows:
        try:
            good.append(journal_rows_to_table([row]))
        except Exception as exc:  # any conversion failure makes this one row unusable, nothing more
            rejected.append((row, f"{type(exc).__name__}: {one_line(exc)}"))
    return (pa.concat_tables(good) if good else RECORD_SCHEMA.empty_table()), rejected


@dataclass
class LiveJournals:
    """The journals of a record folder as read at one moment, before its shards are listed."""

    scans: list[tuple[Path, JournalScan]]
    problems: list[str]  # one line each: a journal that could not be read, and why

    def uncompacted(self, shards: Iterable[str | Path]) -> tuple[list[dict[str, Any]], list[str]]:
        """Rows of the journals whose shard is not among `shards` (listed *after* the journals were read).

        A shard appears before its journal goes: a journal compacted since it was read has its shard in a later
        listing, and one that vanished before it could be read was compacted, so its shard is listed too.
        """
        compacted = {Path(shard).stem.rsplit("-", 1)[-1] for shard in shards
                     if Path(shard).name.startswith("records-")}
        rows: list[dict[str, Any]] = []
        problems = list(self.problems)
        for journal, scan in self.scans:
            if journal_id(journal) in compacted:
                continue
            rows.extend(scan.rows)
            if scan.damaged:
                problems.append(f"{journal}: {scan.describe_damage()} (skipped)")
        return rows, problems


def read_live_journals(out_dir: str | Path) -> LiveJournals:
    """Read every journal of a record folder now; list the shards only afterwards (see `uncompacted`)."""
    live = LiveJournals(scans=[], problems=[])
    for journal in sorted((Path(out_dir) / JOURNAL_DIR).glob(f"*{JOURNAL_SUFFIX}")):
        if journal.is_dir():
            live.problems.append(f"{journal}: a folder, not a journal file (skipped)")
            continue
        try:
            live.scans.append((journal, scan_journal(journal)))
        except FileNotFoundError:
            continue  # compacted since it was listed: its shard will be in the listing
        except OSError as exc:
            live.problems.append(f"{journal}: unreadable journal ({exc.strerror or exc}) (skipped)")
    return live


# -- compaction and quarantine -----------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _free_name(folder: Path, name: str) -> Path:
    target, n = folder / name, 1
    while target.exists():
        target, n = folder / f"{name}.{n}", n + 1
    return target


def quarantine(path: Path, out_dir: Path, reason: str) -> Path:
    """Move `path` to `<out>/_quarantine/` with a `.reason` file beside it (never deleted: a person decides)."""
    folder = out_dir / QUARANTINE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    target = _free_name(folder, path.name)
    os.replace(path, target)
    target.with_name(f"{target.name}.reason").write_text(f"{path}: {reason}\n")
    fsync_dir(folder)
    fsync_dir(path.parent)
    log.warning("quarantined %s → %s: %s", path, target, reason)
    return target


def _write_rejected_rows(journal: Path, out_dir: Path, rejected: list[tuple[dict[str, Any], str]]) -> Path:
    folder = out_dir / QUARANTINE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    target = _free_name(folder, f"{journal.stem}.rows.jsonl")
    with open(target, "wb") as f:
        for row, reason in rejected:
            f.write(orjson.dumps({"journal": journal.name, "reason": reason, "row": row}) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(folder)
    log.warning("journal %s: %d row(s) cannot be records, kept in %s: %s", journal.name, len(rejected), target,
                rejected[0][1])
    return target


def _write_shard(journal: Path, out_dir: Path, table: pa.Table) -> Path:
    stamp = table.column("started_at")[0].as_py().strftime("%Y%m%dT%H%M%S")
    shard = out_dir / f"records-{stamp}-{journal_id(journal)}.parquet"
    tmp = out_dir / f".{shard.name}.tmp"
    try:
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, shard)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a partial temp file would only take space the retry needs
        raise
    fsync_dir(out_dir)
    return shard


def compact_journal(journal: Path, out_dir: Path) -> Path | None:
    """Write the journal's records as one Parquet shard (atomically), then remove the journal.

    Rows that cannot be shard rows go to the quarantine with their reason; a journal with unreadable bytes is
    moved to the quarantine instead of being deleted.
    """
    scan = scan_journal(journal)
    table, rejected = records_table(scan.rows)
    shard = _write_shard(journal, out_dir, table) if table.num_rows else None
    if rejected:
        _write_rejected_rows(journal, out_dir, rejected)
    if scan.damaged:
        log.warning("journal %s: %d unreadable region(s): %s; kept %d record(s)", journal.name, len(scan.damaged),
                    scan.describe_damage(), table.num_rows)
        quarantine(journal, out_dir, f"unreadable regions: {scan.describe_damage()}; "
                                     f"the other {len(scan.rows)} frame(s) are in {shard or 'no shard'}")
    else:
        journal.unlink()
        fsync_dir(journal.parent)
    return shard


# -- the writer --------------------------------------------------------------------------------------------------


class RecordWriter:
    """Appends records durably; `write()` returns a Future that resolves once the record is on disk."""

    def __init__(self, out_dir: str | Path, *, rotate_bytes: int = 64 << 20, rotate_seconds: float = 300.0,
                 fsync: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.journal_dir = self.out_dir / JOURNAL_DIR
        self.rotate_bytes, self.rotate_seconds, self.fsync = rotate_bytes, rotate_seconds, fsync
        self._queue: queue.Queue[tuple[bytes, Future] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._journal: Path | None = None
        self._closed: list[Path] = []  # closed journals not compacted yet (a failed write or compaction)
        self._compacted_at = 0.0  # when compaction last ran (a failed one is retried `rotate_seconds` later)
        self._opened_at = 0.0
        self._size = 0
        self.shards_written: list[Path] = []

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Recover journals a crash left behind, then start the writer thread.

        Bad rows and a failed compaction never raise here (the gateway must serve): bad rows are quarantined,
        and a journal that could not be compacted is kept and retried by the writer thread.
        """
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        for leftover in sorted(self.journal_dir.glob(f"*{JOURNAL_SUFFIX}")):
            if not leftover.is_file():
                log.warning("%s is not a journal file; left alone", leftover)
                continue
            self._closed.append(leftover)
        self._compact_closed()
        self._thread = threading.Thread(target=self._run, name="polar-record-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Flush everything queued and compact the open journal into a shard."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join()
        self._thread = None

    def quarantine_shard(self, shard: Path, reason: str) -> None:
        """Move an unreadable shard aside (so the gateway keeps serving) with the reason beside it.

        If it cannot be moved (a full disk), it stays where it is: readers skip it with a line naming it.
        """
        try:
            quarantine(shard, self.out_dir, f"unreadable shard: {reason}")
        except OSError as exc:
            log.warning("unreadable shard %s (%s) could not be quarantined (%s); left in place", shard, reason,
                        one_line(exc))

    # -- API -----------------------------------------------------------------------------------------------------

    def write(self, row: dict[str, Any]) -> Future:
        """Queue one record (a journal dict); the Future resolves when it is durable."""
        fut: Future = Future()
        self._queue.put((encode_frame(orjson.dumps(row)), fut))
        return fut

    # -- writer thread -------------------------------------------------------------------------------------------

    def _open(self) -> None:
        name = f"journal-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:12]}{JOURNAL_SUFFIX}"
        self._journal = self.journal_dir / name
        # Unbuffered: after a failed write no bytes may linger in a buffer and land later, after a partial frame.
        self._fd = os.open(self._journal, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._opened_at, self._size = time.monotonic(), 0
        self._write_all(FILE_HEADER)
        fsync_dir(self.journal_dir)

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self._size += len(data)

    def _close_journal(self) -> None:
        """Stop appending to the open journal; it joins the ones waiting for compaction."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._journal is not None:
            self._closed.append(self._journal)
            self._journal = None

    def _compact_closed(self) -> None:
        self._compacted_at = time.monotonic()
        for journal in list(self._closed):
            try:
                shard = compact_journal(journal, self.out_dir)
            except Exception as exc:  # e.g. the disk is full: the journal stays, its records readable from it
                if isinstance(exc, FileNotFoundError) and not journal.exists():
                    log.warning("journal %s vanished before compaction", journal)
                    self._closed.remove(journal)
                    continue
                # A warning, not an error: mitmproxy exits on an error logged during startup.
                log.warning("compaction of %s failed (%s: %s); it will be retried in %.0f s or at the next "
                            "rotation", journal, type(exc).__name__, one_line(exc), self.rotate_seconds,
                            exc_info=True)
                continue
            if shard:
                self.shards_written.append(shard)
            log.info("compacted journal %s → %s", journal.name, shard)
            self._closed.remove(journal)

    def _rotate(self) -> None:
        self._close_journal()
        self._compact_closed()

    def _retry_due(self) -> bool:
        return bool(self._closed) and time.monotonic() - self._compacted_at >= self.rotate_seconds

    def _due(self, stopping: bool) -> bool:
        if self._fd is None:
            return stopping and bool(self._closed)
        return stopping or self._size >= self.rotate_bytes or time.monotonic() - self._opened_at > self.rotate_seconds

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                first = self._queue.get(timeout=min(1.0, self.rotate_seconds))
            except queue.Empty:
                if self._due(False):
                    self._rotate()
                elif self._retry_due():
                    self._compact_closed()
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
            if self._due(stopping):
                self._rotate()

    def _append(self, items: list[tuple[bytes, Future]]) -> None:
        try:
            if self._fd is None:
                self._open()
            self._write_all(b"".join(frame for frame, _ in items))
            if self.fsync:
                assert self._fd is not None
                os.fsync(self._fd)
        except Exception as exc:
            # The journal may now end in a partial frame, and after a failed fsync the kernel may have dropped
            # the pages: never append to it again. The next record opens a new journal.
            log.error("journal write failed (%s); %d record(s) not acknowledged; starting a new journal", exc,
                      len(items))
            try:
                self._close_journal()
            except OSError:
                log.exception("closing the failed journal")
            for _, fut in items:
                fut.set_exception(exc)
            return
        for _, fut in items:
            fut.set_result(None)
