"""The record folder's journal format: checksummed frames, journal and shard names, and reading live journals.

Shared by the writer (`storage/journal.py`: appends frames, compacts journals into shards) and the one reader of
records (`storage/records.py`: reads the journals a compaction has not reached yet), so neither imports the other.
Record-agnostic: a frame's payload is a JSON object, and rows here are dicts; what makes one a record is
`storage/records.py`'s.

Every frame starts with a sync marker, so a reader resynchronises on the next intact frame after a corrupt region
(journals written before the marker existed are read too: they have no file header). A shard is named after its
journal (`records-<time>-<journal id>.parquet`) and appears before its journal goes, so a reader that reads the
journals first and lists the shards second, skipping journals whose shard exists, never misses nor doubles a
record (`read_live_journals`, `LiveJournals.uncompacted`).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

FILE_HEADER = b"POLARJ2\n"  # starts every journal in the framed format; journals without it are legacy
FRAME_MAGIC = b"\xf0PJ\x1e"  # starts every frame: what recovery searches for after a corrupt region
FRAME_HEADER = struct.Struct("<II")  # payload length, crc32 of the payload (the whole frame header in legacy)
JOURNAL_DIR = "_journal"
JOURNAL_SUFFIX = ".polarj"
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

    def __init__(self, data: bytes, marked: bool | None = None) -> None:
        self.data = data
        self.marked = data.startswith(FILE_HEADER) if marked is None else marked
        self.prefix = FRAME_MAGIC if self.marked else b""
        self.first = len(FILE_HEADER) if self.marked else 0

    def frame_at(self, pos: int) -> tuple[int, bytes] | str:
        """(end, payload) of an intact frame at `pos`, or why there is none."""
        data, start = self.data, pos + len(self.prefix) + FRAME_HEADER.size
        if start > len(data):
            return "a torn frame header at the end (a write that failed or was cut; never acknowledged)"
        if data[pos : pos + len(self.prefix)] != self.prefix:
            return "no frame marker (corrupt bytes)"
        length, crc = FRAME_HEADER.unpack_from(data, pos + len(self.prefix))
        if start + length > len(data):
            return "a frame cut at the end of the file (or a corrupt length)"
        payload = data[start : start + length]
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


@dataclass
class AppendedFrames:
    """The frames in bytes appended to a marked journal, as file offsets (`scan_appended`)."""

    payloads: list[tuple[int, int]]  # (start, end) of each intact frame's payload
    damaged: list[tuple[int, int, str]]
    resume: int  # where the next scan starts: the end of the last whole frame, or a frame still being written


def scan_appended(data: bytes, base: int) -> AppendedFrames:
    """The frames of `data`, the bytes of a marked journal from file offset `base` (a frame boundary) to its end
    now. A frame cut at the end is one still being written: the scan resumes at its start next time, as it does at
    a damaged region nothing intact follows yet. Damage before an intact frame is skipped, as `scan_bytes` does."""
    frames, found = _Frames(data, marked=True), AppendedFrames([], [], base + len(data))
    pos = 0
    while pos < len(data):
        at = frames.frame_at(pos)
        if not isinstance(at, str):
            end, _ = at
            found.payloads.append((base + pos + len(FRAME_MAGIC) + FRAME_HEADER.size, base + end))
            pos = end
            continue
        after = frames.next_frame(pos)
        if after == len(
            data
        ):  # nothing intact after it (yet): a write in progress, or damage to report later
            found.resume = base + pos
            break
        found.damaged.append((base + pos, base + after, at))
        pos = after
    return found


def scan_journal(path: Path) -> JournalScan:
    """Every record of the journal at `path`; raises OSError if it cannot be read (gone, a folder, …)."""
    return scan_bytes(path.read_bytes())


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Every intact record of a journal (corrupt regions and a torn tail are skipped)."""
    return scan_journal(path).rows


def journal_id(path: Path) -> str:
    """What names a journal's shard: the last `-` part of its name (a random hex id for gateway journals)."""
    return path.stem.rsplit("-", 1)[-1]


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
        compacted = {
            Path(shard).stem.rsplit("-", 1)[-1] for shard in shards if Path(shard).name.startswith("records-")
        }
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
