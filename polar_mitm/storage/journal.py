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
The frame format and those names are `storage/journal_format.py`'s; what a record is, `storage/records.py`'s.

One writer per folder: `start` takes an exclusive `flock` on `<out>/_journal/writer.lock` and holds it for the
writer's life (its compaction child inherits it), so a second gateway on a live gateway's folder refuses in one
line (`RecordFolderBusy`) instead of compacting and removing the live journal under it. Record folders, journals,
shards and the quarantine are created owner-only (0700 folders, 0600 files): another user's process cannot read a
record (where sessions run as the same user, only the sandbox keeps them out).

The event loop only enqueues and awaits a future. Appends and fsyncs happen on the writer thread; compaction on a
compactor thread of its own, so a rotation never holds up an acknowledgement. While the gateway serves, that thread
compacts in a child process (`storage/compact_child.py`): parsing a journal's JSON and building Arrow
columns from Python lists holds the GIL — in the gateway's process it took a quarter of the gateway's samples at 8k
tokens (benchmarks/bench_gateway.py) and stalled the event loop. At start and at close, with no call waiting, it
compacts in-process.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.storage.journal_format import (
    FILE_HEADER,
    JOURNAL_DIR,
    JOURNAL_SUFFIX,
    encode_frame,
    journal_id,
    scan_journal,
)
from polar_mitm.storage.location import FILE_MODE, one_line, private_dir
from polar_mitm.storage.records import records_table

log = logging.getLogger(__name__)

QUARANTINE_DIR = "_quarantine"
LOCK_FILE = "writer.lock"  # in `_journal/`: held (flock) by the folder's one record writer


class RecordFolderBusy(OSError):
    """Another record writer (a live gateway) holds the folder: writing beside it would remove its journal."""


def lock_folder(journal_dir: Path) -> int:
    """An fd holding an exclusive flock on `journal_dir`'s lock file (released when every copy of it is closed:
    the writer's, and its compaction child's); raises RecordFolderBusy naming the folder and the holder."""
    fd = os.open(journal_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RecordFolderBusy(
            f"{journal_dir.parent} is in use by another record writer (pid {holder}): give each gateway its own "
            f"records folder, or stop the other first"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the next one's message
    return fd


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
    folder = private_dir(out_dir / QUARANTINE_DIR)
    target = _free_name(folder, path.name)
    os.replace(path, target)
    _write_private(target.with_name(f"{target.name}.reason"), f"{path}: {reason}\n".encode())
    fsync_dir(folder)
    fsync_dir(path.parent)
    log.warning("quarantined %s → %s: %s", path, target, reason)
    return target


def _write_rejected_rows(journal: Path, out_dir: Path, rejected: list[tuple[dict[str, Any], str]]) -> Path:
    folder = private_dir(out_dir / QUARANTINE_DIR)
    target = _free_name(folder, f"{journal.stem}.rows.jsonl")
    lines = b"".join(
        orjson.dumps({"journal": journal.name, "reason": reason, "row": row}) + b"\n"
        for row, reason in rejected
    )
    _write_private(target, lines, fsync=True)
    fsync_dir(folder)
    log.warning(
        "journal %s: %d row(s) cannot be records, kept in %s: %s",
        journal.name,
        len(rejected),
        target,
        rejected[0][1],
    )
    return target


def _write_private(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """Write a new owner-only file (records and their reasons are nobody else's to read)."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE), "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _write_shard(journal: Path, out_dir: Path, table: pa.Table) -> Path:
    stamp = table.column("started_at")[0].as_py().strftime("%Y%m%dT%H%M%S")
    shard = out_dir / f"records-{stamp}-{journal_id(journal)}.parquet"
    tmp = out_dir / f".{shard.name}.tmp"
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.chmod(tmp, FILE_MODE)  # before it has its name: no reader ever sees it open to others
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
        log.warning(
            "journal %s: %d unreadable region(s): %s; kept %d record(s)",
            journal.name,
            len(scan.damaged),
            scan.describe_damage(),
            table.num_rows,
        )
        quarantine(
            journal,
            out_dir,
            f"unreadable regions: {scan.describe_damage()}; "
            f"the other {len(scan.rows)} frame(s) are in {shard or 'no shard'}",
        )
    else:
        journal.unlink()
        fsync_dir(journal.parent)
    return shard


def compact_journals_in_child(
    journals: list[Path], out_dir: Path, lock_fd: int | None = None
) -> dict[Path, Path | None | str]:
    """Compact `journals` in a child Python (out of this process's GIL); per journal its shard (None: no rows), or
    why it failed. The child dies with this process (compact_child.py) and inherits the folder's lock (`lock_fd`),
    so a killed gateway's folder is free for the next gateway's recovery only once its compaction is gone too;
    its log lines go to this process's stderr."""
    cmd = [sys.executable, "-m", "polar_mitm.storage.compact_child", str(out_dir), *map(str, journals)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")])),
        PARENT_ENV: str(os.getpid()),
    }
    try:
        done = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            env=env,
            timeout=CHILD_TIMEOUT_S,
            check=False,
            pass_fds=() if lock_fd is None else (lock_fd,),
        )
    except subprocess.TimeoutExpired:
        return dict.fromkeys(journals, f"the compaction did not end in {CHILD_TIMEOUT_S} s")
    results: dict[Path, Path | None | str] = {}
    for line in done.stdout.splitlines():
        item = orjson.loads(line)
        shard = item.get("shard")
        results[Path(item["journal"])] = (
            item["error"] if item.get("error") else Path(shard) if shard else None
        )
    for journal in journals:  # a child that died early reported nothing for the rest
        results.setdefault(journal, f"the compaction process exited with {done.returncode}")
    return results


PARENT_ENV = "POLAR_COMPACT_PARENT"  # the gateway's pid: the child ends if that process is gone
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding polar_mitm/, for the child
CHILD_TIMEOUT_S = 600


# -- the writer --------------------------------------------------------------------------------------------------


class RecordWriter:
    """Appends records durably; `write()` returns a Future that resolves once the record is on disk."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        rotate_bytes: int = 64 << 20,
        rotate_seconds: float = 300.0,
        fsync: bool = True,
        compact_in_child: bool = True,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.journal_dir = self.out_dir / JOURNAL_DIR
        self.rotate_bytes, self.rotate_seconds, self.fsync = rotate_bytes, rotate_seconds, fsync
        self._queue: queue.Queue[tuple[bytes, Future] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._journal: Path | None = None
        self._closed: list[Path] = []  # closed journals not compacted yet (a failed write or compaction)
        self._closed_lock = threading.Lock()  # the writer adds to _closed, the compactor takes from it
        self._compacted_at = 0.0  # when compaction last ran (a failed one is retried `rotate_seconds` later)
        self._compactor: threading.Thread | None = None
        self._compact_requests: queue.Queue[bool | None] = (
            queue.Queue()
        )  # True: compact now; None: drain, stop
        self._opened_at = 0.0
        self._size = 0
        self.shards_written: list[Path] = []
        self.compact_in_child = compact_in_child
        self._lock_fd: int | None = None  # the folder's lock, held from `start` to the end of `close`

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Recover journals a crash left behind, then start the writer thread.

        Bad rows and a failed compaction never raise here (the gateway must serve): bad rows are quarantined,
        and a journal that could not be compacted is kept and retried by the writer thread. Raises
        RecordFolderBusy when another writer holds the folder (its live journal is never touched).
        """
        private_dir(self.journal_dir)
        self._lock_fd = lock_folder(self.journal_dir)
        for leftover in sorted(self.journal_dir.glob(f"*{JOURNAL_SUFFIX}")):
            if not leftover.is_file():
                log.warning("%s is not a journal file; left alone", leftover)
                continue
            self._closed.append(leftover)
        self._compact_closed(in_child=False)
        self._compactor = threading.Thread(
            target=self._compact_loop, name="polar-record-compactor", daemon=True
        )
        self._compactor.start()
        self._thread = threading.Thread(target=self._run, name="polar-record-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Flush everything queued and compact the open journal into a shard."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join()
        self._thread = None
        assert self._compactor is not None
        self._compact_requests.put(None)
        self._compactor.join()
        self._compactor = None
        self._release_lock()

    def _release_lock(self) -> None:
        """Free the folder for the next writer: after the last compaction, so it never sees a journal of ours."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def quarantine_shard(self, shard: Path, reason: str) -> None:
        """Move an unreadable shard aside (so the gateway keeps serving) with the reason beside it.

        If it cannot be moved (a full disk), it stays where it is: readers skip it with a line naming it.
        """
        try:
            quarantine(shard, self.out_dir, f"unreadable shard: {reason}")
        except OSError as exc:
            log.warning(
                "unreadable shard %s (%s) could not be quarantined (%s); left in place",
                shard,
                reason,
                one_line(exc),
            )

    # -- API -----------------------------------------------------------------------------------------------------

    def write(self, row: dict[str, Any]) -> Future:
        """Queue one record (a journal dict); the Future resolves when it is durable."""
        fut: Future = Future()
        self._queue.put((encode_frame(orjson.dumps(row)), fut))
        return fut

    # -- writer thread -------------------------------------------------------------------------------------------

    def _open(self) -> None:
        name = (
            f"journal-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:12]}{JOURNAL_SUFFIX}"
        )
        self._journal = self.journal_dir / name
        # Unbuffered: after a failed write no bytes may linger in a buffer and land later, after a partial frame.
        self._fd = os.open(
            self._journal, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, FILE_MODE
        )
        self._opened_at, self._size = time.monotonic(), 0
        self._write_all(FILE_HEADER)
        fsync_dir(self.journal_dir)

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self._size += len(data)

    def _close_journal(self) -> None:
        """Stop appending to the open journal; it joins the ones waiting for compaction."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._journal is not None:
            with self._closed_lock:
                self._closed.append(self._journal)
            self._journal = None

    # -- compactor thread ----------------------------------------------------------------------------------------

    def _compact_loop(self) -> None:
        while True:
            request = self._compact_requests.get()
            if request is None:  # closing: no call waits any more, so in-process (no child to start)
                self._compact_closed(in_child=False)
                return
            self._compact_closed(in_child=self.compact_in_child)

    def _compact_closed(self, *, in_child: bool) -> None:
        self._compacted_at = time.monotonic()
        with self._closed_lock:
            journals = list(self._closed)
        if not journals:
            return
        if in_child:
            results = compact_journals_in_child(journals, self.out_dir, self._lock_fd)
        else:
            results = {}
            for journal in journals:
                try:
                    results[journal] = compact_journal(journal, self.out_dir)
                except Exception as exc:
                    log.debug("compaction of %s", journal, exc_info=True)
                    results[journal] = f"{type(exc).__name__}: {one_line(exc)}"
        for journal, result in results.items():
            if isinstance(result, str):
                if (
                    not journal.exists()
                ):  # compacted meanwhile (a reader never doubles: its shard is named after it)
                    log.warning("journal %s vanished before compaction", journal)
                else:
                    # A warning, not an error: mitmproxy exits on an error logged during startup.
                    log.warning(
                        "compaction of %s failed (%s); it will be retried in %.0f s or at the next rotation",
                        journal,
                        result,
                        self.rotate_seconds,
                    )
                    continue
            elif result is not None:
                self.shards_written.append(result)
                log.info("compacted journal %s → %s", journal.name, result)
            with self._closed_lock:
                self._closed.remove(journal)

    # -- writer thread -------------------------------------------------------------------------------------------

    def _rotate(self) -> None:
        self._close_journal()
        self._compact_requests.put(True)

    def _retry_due(self) -> bool:
        with self._closed_lock:
            waiting = bool(self._closed)
        return waiting and time.monotonic() - self._compacted_at >= self.rotate_seconds

    def _due(self) -> bool:
        if self._fd is None:
            return False
        return self._size >= self.rotate_bytes or time.monotonic() - self._opened_at > self.rotate_seconds

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                first = self._queue.get(timeout=min(1.0, self.rotate_seconds))
            except queue.Empty:
                if self._due():
                    self._rotate()
                elif self._retry_due():
                    self._compacted_at = time.monotonic()  # one request per period, however long it takes
                    self._compact_requests.put(True)
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
            if stopping:
                self._close_journal()  # close() then has the compactor compact it
            elif self._due():
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
            log.error(
                "journal write failed (%s); %d record(s) not acknowledged; starting a new journal",
                exc,
                len(items),
            )
            try:
                self._close_journal()
            except OSError:
                log.exception("closing the failed journal")
            for _, fut in items:
                fut.set_exception(exc)
            return
        for _, fut in items:
            fut.set_result(None)
