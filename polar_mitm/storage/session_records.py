"""One session's records from a record folder that keeps growing, read again and again at the cost of what changed.

`records.read_session` reads the folder whole each time: every live journal parsed, every shard opened. The rollout
service reads each session as it ends, and a gateway's journal grows to 64 MB before it is compacted, so that cost
half a second a session near the end of a journal (17 MB: 126 ms, 68 MB: 463 ms) and grew with the run.

`SessionRecords` keeps, for each live journal, an open descriptor, how far it has read, and where each session's
frames are (found by the row's leading `session_id`, without parsing the row); and for each shard the sessions it
holds. A read scans only the bytes appended since the last one, and parses only the session's own frames. The
contract is `read_session`'s: journals are read before the shards are listed, and a journal whose shard is listed
is left out. The open descriptor keeps a journal compacted in between readable.

`read_live_session` keeps one reader per folder for the process (32 folders at most); a reader idle for a minute is
closed, so its descriptors do not keep journals compacted since on the disk.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.storage.journal_format import (
    FILE_HEADER,
    JOURNAL_DIR,
    JOURNAL_SUFFIX,
    journal_id,
    scan_appended,
    scan_bytes,
)
from polar_mitm.storage.location import Location, one_line
from polar_mitm.storage.records import (
    RECORD_SCHEMA,
    Inputs,
    add_parquet_source,
    journal_folders,
    read_session,
    records_table,
)

log = logging.getLogger(__name__)

# A record's journal row starts {"request_id":"…","session_id":"…" (Record's field order): the id is read from the
# row's head. A JSON string never holds an unescaped quote, so the pattern cannot match inside a value.
SESSION_ID = re.compile(rb'"session_id":"([^"\\]*)"')
HEAD = 512
READERS_KEPT = 32  # folders with a reader kept (`reader_for`), least recently used dropped
# A reader not used for this long is closed: its descriptors would keep journals compacted since on the disk.
READER_IDLE_S = 60.0


@functools.cache
def _empty() -> pa.Table:
    return (
        RECORD_SCHEMA.empty_table()
    )  # ~0.1 ms each time: most reads of a service's sleep sessions find nothing


def _session_of(payload: bytes) -> str | None:
    found = SESSION_ID.search(payload, 0, HEAD)
    if found:
        return found.group(1).decode("utf-8", "replace")
    try:
        row = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    value = row.get("session_id") if isinstance(row, dict) else None
    return value if isinstance(value, str) else None


@dataclass
class _Journal:
    """A live journal being followed: its descriptor, how far it was read, and each session's frames in it."""

    path: Path
    fd: int
    marked: bool | None = (
        None  # None until its header is there; False: a legacy journal, read whole each time
    )
    offset: int = 0
    frames: dict[str | None, list[tuple[int, int]]] = field(default_factory=dict)
    damage: str = ""

    def follow(self) -> None:
        size = os.fstat(self.fd).st_size
        if self.marked is None:
            if size < len(FILE_HEADER):
                return
            self.marked = os.pread(self.fd, len(FILE_HEADER), 0) == FILE_HEADER
            self.offset = len(FILE_HEADER) if self.marked else 0
        if not self.marked or size <= self.offset:
            return
        found = scan_appended(os.pread(self.fd, size - self.offset, self.offset), self.offset)
        for start, end in found.payloads:
            head = os.pread(self.fd, min(end - start, HEAD), start)
            session = _session_of(head if end - start <= HEAD else os.pread(self.fd, end - start, start))
            self.frames.setdefault(session, []).append((start, end))
        self.offset = found.resume
        self.damage = "; ".join(f"bytes {a}–{b}: {why}" for a, b, why in found.damaged)

    def rows(self, session_id: str) -> list[dict]:
        if not self.marked:  # legacy: no frame markers to follow
            whole = scan_bytes(os.pread(self.fd, os.fstat(self.fd).st_size, 0))
            return [r for r in whole.rows if r.get("session_id") == session_id]
        rows = []
        for start, end in self.frames.get(session_id, []):
            with contextlib.suppress(orjson.JSONDecodeError):
                row = orjson.loads(os.pread(self.fd, end - start, start))
                if isinstance(row, dict):
                    rows.append(row)
        return rows

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # a reader dropped from the cache while in use still closes what it opened
        self.close()


@dataclass
class _Shard:
    key: tuple[int, int]  # (size, mtime_ns): a shard rewritten in place is read again
    sessions: frozenset[str]


class SessionRecords:
    """Reads sessions' records from one local record folder (and the `gw-K`/`node-*` folders below it) as it grows;
    thread-safe. `read(session_id)` returns what `records.read_session` would."""

    def __init__(self, location: str | Path) -> None:
        self.root = Path(location)
        self._journals: dict[Path, _Journal] = {}
        self._shards: dict[str, _Shard] = {}
        self._lock = threading.Lock()
        self.used_at = time.monotonic()

    def read(self, session_id: str) -> pa.Table:
        with self._lock:
            if not self.root.is_dir():
                return _empty()
            self._follow_journals()  # before the shards are listed (see the module's docstring)
            shards = self._list_shards()
            compacted = {
                Path(s).stem.rsplit("-", 1)[-1] for s in shards if Path(s).name.startswith("records-")
            }
            for path in [p for p in self._journals if journal_id(p) in compacted]:
                self._journals.pop(path).close()
            tables = [
                self._shard_rows(path, session_id) for path, s in shards.items() if session_id in s.sessions
            ]
            for journal in self._journals.values():
                if journal.damage:
                    log.warning("%s: %s (skipped)", journal.path, journal.damage)
                rows = journal.rows(session_id)
                if rows:
                    table, rejected = records_table(rows)
                    for row, reason in rejected:
                        log.warning(
                            "%s: row of request %r skipped: %s",
                            journal.path.parent,
                            str(row.get("request_id")),
                            reason,
                        )
                    tables.append(table)
            tables = [t for t in tables if t is not None and t.num_rows]
            return pa.concat_tables(tables) if tables else _empty()

    def close(self) -> None:
        with self._lock:
            for journal in self._journals.values():
                journal.close()
            self._journals.clear()

    def _follow_journals(self) -> None:
        present = []
        for folder in journal_folders(self.root):
            with contextlib.suppress(OSError):
                present += sorted(
                    p for p in (folder / JOURNAL_DIR).iterdir() if p.name.endswith(JOURNAL_SUFFIX)
                )
        for path in [p for p in self._journals if p not in set(present)]:
            self._journals.pop(path).close()  # compacted (its shard is listed next) or removed
        for path in present:
            if path not in self._journals:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue  # compacted since the listing: its shard will be listed
                except OSError as exc:
                    log.warning("%s: unreadable journal (%s) (skipped)", path, exc.strerror or exc)
                    continue
                self._journals[path] = _Journal(path, fd)
        self._journals = dict(sorted(self._journals.items(), key=lambda item: present.index(item[0])))
        for journal in self._journals.values():
            journal.follow()

    def _list_shards(self) -> dict[str, _Shard]:
        listed: dict[str, _Shard] = {}
        for path in Location.of(self.root).parquet_files():
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                continue
            key = (stat.st_size, stat.st_mtime_ns)
            known = self._shards.get(path)
            listed[path] = known if known is not None and known.key == key else self._index_shard(path, key)
        self._shards = listed
        return listed

    def _index_shard(self, path: str, key: tuple[int, int]) -> _Shard:
        """The sessions a shard holds (none for a file that is not records, or cannot be read: said once)."""
        found = Inputs(sources=[], skipped=[], problems=[])
        add_parquet_source(path, Location.of(path).filesystem, found)
        for problem in found.problems:
            log.warning("%s", problem)
        sessions: frozenset[str] = frozenset()
        if found.sources:
            try:
                column = pq.read_table(path, columns=["session_id"]).column("session_id")
                sessions = frozenset(column.unique().to_pylist())
            except (OSError, pa.ArrowException) as exc:
                log.warning("%s: unreadable (%s), skipped", path, one_line(exc))
        return _Shard(key, sessions)

    def _shard_rows(self, path: str, session_id: str) -> pa.Table | None:
        try:
            return pq.read_table(path, schema=RECORD_SCHEMA, filters=[("session_id", "==", session_id)])
        except (OSError, pa.ArrowException) as exc:
            log.warning("%s: unreadable (%s), skipped", path, one_line(exc))
            return None


_readers: OrderedDict[Path, SessionRecords] = OrderedDict()
_readers_lock = threading.Lock()


def reader_for(location: str | Path) -> SessionRecords:
    """The process's reader of a local record folder, kept for the next read (`READERS_KEPT` folders at most)."""
    key = Path(os.path.abspath(location))  # not resolve(): no symlink walk on every read
    now = time.monotonic()
    with _readers_lock:
        reader = _readers.pop(key, None) or SessionRecords(key)
        reader.used_at = now
        for idle in [k for k, r in _readers.items() if now - r.used_at > READER_IDLE_S]:
            _readers.pop(idle).close()
        _readers[key] = reader
        while len(_readers) > READERS_KEPT:
            _readers.popitem(last=False)[1].close()
        return reader


def read_live_session(location: str | Path, session_id: str) -> pa.Table:
    """`records.read_session`, for a folder read again and again as it grows (a local one: followed by
    `reader_for`; any other location is read whole)."""
    if not Location.of(location).is_local_folder:
        return read_session(location, session_id)
    return reader_for(location).read(session_id)
