"""Reading the records store: compacted shards plus the live journal, local or under any pyarrow filesystem URI.

One reader for every consumer: `list_sources` lists the inputs (record Parquet files, and the records still in a
local folder's live journal) and `merge` streams them; `scan_records` / `read_all` read them whole. A live journal
is read *before* its folder is listed and a journal whose shard is listed is left out (`storage/journal.py`), so a
compaction running meanwhile can neither hide a record nor show it twice. Unreadable parts are skipped, one line
each, and never stop the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from polar_mitm.records import RECORD_SCHEMA
from polar_mitm.storage.journal import (
    JOURNAL_DIR,
    SHARD_GLOB,
    LiveJournals,
    read_live_journals,
    records_table,
)
from polar_mitm.storage.location import Location, StorageError, one_line

log = logging.getLogger("polar_mitm.records")

# The columns a reader of records needs, and those it uses when present (older versions lack some).
REQUIRED_COLUMNS = ("request_id", "session_id", "seq", "finish_reason", "prompt_ids", "completion_ids",
                    "completion_logprobs")
OPTIONAL_COLUMNS = ("task_id", "started_at", "weight_version", "error", "temperature", "top_p", "top_k", "min_p",
                    "greedy", "spliced_turns", "call_kind",
                    "output_constraint")


@dataclass
class Source:
    """One input: a Parquet file on some filesystem, or records held in memory (e.g. a live journal)."""

    name: str
    num_rows: int
    columns: tuple[str, ...]
    filesystem: pafs.FileSystem | None = None
    table: pa.Table | None = None

    def _open(self) -> pq.ParquetFile:
        # Opened per pass and closed after: an open reader keeps the file's buffers alive.
        return pq.ParquetFile(self.name, filesystem=self.filesystem)

    def read(self, columns: Sequence[str]) -> pa.Table:
        if self.table is not None:
            return self.table.select(list(columns))
        try:
            with self._open() as parquet:
                return parquet.read(columns=list(columns))
        except (OSError, pa.ArrowException) as exc:  # e.g. a corrupt data page behind an intact footer
            raise StorageError(f"{self.name}: unreadable ({one_line(exc)})") from exc

    def read_records(self) -> pa.Table:
        """Every column, with RECORD_SCHEMA (older versions' missing columns read as null)."""
        if self.table is not None:
            return self.table
        try:
            return pq.read_table(self.name, filesystem=self.filesystem, schema=RECORD_SCHEMA)
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(f"{self.name}: unreadable ({one_line(exc)})") from exc

    def batches(self, batch_rows: int) -> Iterator[pa.RecordBatch | pa.Table]:
        if self.table is not None:
            for start in range(0, self.table.num_rows, batch_rows):
                yield self.table.slice(start, batch_rows).select(list(self.columns))
            return
        try:
            with self._open() as parquet:
                yield from parquet.iter_batches(batch_size=batch_rows, columns=list(self.columns))
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(f"{self.name}: unreadable ({one_line(exc)})") from exc


def _record_columns(schema: pa.Schema) -> tuple[str, ...] | None:
    names = set(schema.names)
    if not set(REQUIRED_COLUMNS) <= names:
        return None
    return tuple(n for n in (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS) if n in names)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def _list_of(item: Callable[[pa.DataType], bool]) -> Callable[[pa.DataType], bool]:
    return lambda t: (pa.types.is_list(t) or pa.types.is_large_list(t)) and item(t.value_type)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


# What each column read by merge may be (right names with other types would fail deep inside the builders).
COLUMN_KINDS: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    **{name: (_is_text, "text") for name in ("request_id", "session_id", "task_id", "finish_reason",
                                             "weight_version", "error")},
    "seq": (pa.types.is_integer, "an integer"),
    "prompt_ids": (_list_of(pa.types.is_integer), "a list of integers"),
    "completion_ids": (_list_of(pa.types.is_integer), "a list of integers"),
    "completion_logprobs": (_list_of(_is_number), "a list of numbers"),
    "started_at": (lambda t: pa.types.is_timestamp(t) or pa.types.is_integer(t), "a timestamp"),
}


def _type_problem(schema: pa.Schema, columns: Sequence[str]) -> str | None:
    """Why a file with record column names still cannot be read as records (a column of another type)."""
    for name in columns:
        if name not in COLUMN_KINDS:
            continue
        accepts, kind = COLUMN_KINDS[name]
        if not accepts(schema.field(name).type):
            return f"column {name} is {schema.field(name).type}, expected {kind}"
    return None


def table_source(table: pa.Table, name: str = "<memory>") -> Source:
    """An in-memory records table as a merge input."""
    columns = _record_columns(table.schema)
    if columns is None:
        raise StorageError(f"{name}: not a records table (needs {', '.join(REQUIRED_COLUMNS)})")
    problem = _type_problem(table.schema, columns)
    if problem:
        raise StorageError(f"{name}: {problem}")
    return Source(name=name, num_rows=table.num_rows, columns=columns, table=table)


@dataclass
class Inputs:
    """What `list_sources` found: usable sources, files that are not records, and what it could not read."""

    sources: list[Source]
    skipped: list[str]  # other Parquet files (e.g. merged shards): skipped, as pyarrow datasets skip foreign files
    problems: list[str]  # one line each: a file, and why it was skipped or how it was read


def _parquet_source(file: str, fs: pafs.FileSystem, inputs: Inputs) -> None:
    """Add one Parquet file to `inputs`: as a source, a foreign file, or a problem naming what is wrong."""
    try:
        with pq.ParquetFile(file, filesystem=fs) as parquet:
            schema, num_rows = parquet.schema_arrow, parquet.metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        inputs.problems.append(f"{file}: not a readable Parquet file ({one_line(exc)}) (skipped)")
        return
    columns = _record_columns(schema)
    if columns is None:
        inputs.skipped.append(file)
        return
    problem = _type_problem(schema, columns)
    if problem:
        inputs.problems.append(f"{file}: {problem} (skipped)")
        return
    if "schema_version" not in schema.names:
        inputs.problems.append(f"{file}: no schema_version column (read as records of version 1)")
    inputs.sources.append(Source(name=file, num_rows=num_rows, columns=columns, filesystem=fs))


def list_sources(inputs: Sequence[str | Path], *, include_journal: bool = True) -> Inputs:
    """Every records Parquet file under `inputs` (files or folders, sorted), plus a local folder's live journal.

    Files whose columns are not records (e.g. merged shards) are skipped and named in `skipped`; unreadable files
    and columns of the wrong type are skipped with a line in `problems`. Names starting with `_` or `.` are
    skipped, as pyarrow datasets do. A live journal is read *before* its folder is listed, and a journal whose
    shard is listed is left out, so a compaction running meanwhile neither hides nor doubles a record.
    """
    found = Inputs(sources=[], skipped=[], problems=[])
    for uri in inputs:
        where = Location.of(uri)
        if not where.exists:
            raise StorageError(f"{uri}: no such file or folder")
        journals = read_live_journals(where.path) if include_journal and where.is_local_folder else None
        files = where.parquet_files()  # after the journals: see the docstring
        for file in files:
            _parquet_source(file, where.filesystem, found)
        if journals is not None:
            journal = _journal_source(Path(where.path), journals, files, found)
            if journal is not None:
                found.sources.append(journal)
    return found


def _journal_source(folder: Path, journals: LiveJournals, files: list[str], found: Inputs) -> Source | None:
    """Records still in the gateway's live journal (acknowledged, not yet compacted into one of `files`)."""
    rows, problems = journals.uncompacted(files)
    found.problems.extend(problems)
    if not rows:
        return None
    table, rejected = records_table(rows)
    for row, reason in rejected:
        found.problems.append(f"{folder / JOURNAL_DIR}: row of request {str(row.get('request_id'))!r} "
                              f"skipped: {reason}")
    return table_source(table, str(folder / JOURNAL_DIR)) if table.num_rows else None


# -- whole tables ------------------------------------------------------------------------------------------------


@dataclass
class RecordsRead:
    """Records read from a folder, and one line per thing that could not be read (and was skipped)."""

    table: pa.Table
    problems: list[str]


def scan_records(location: str | Path, *, include_journal: bool = True) -> RecordsRead:
    """Every record at `location` (shards, and the live journal's unless `include_journal` is False) with
    RECORD_SCHEMA; unreadable parts are skipped and reported. A folder not written yet holds no records."""
    if not Location.of(location).exists:
        return RecordsRead(table=RECORD_SCHEMA.empty_table(), problems=[])
    found = list_sources([location], include_journal=include_journal)
    tables, problems = [], found.problems
    for source in found.sources:
        try:
            tables.append(source.read_records())
        except StorageError as exc:  # e.g. a corrupt data page behind an intact footer
            problems.append(f"{exc} (skipped)")
    table = pa.concat_tables(tables) if tables else RECORD_SCHEMA.empty_table()
    return RecordsRead(table=table, problems=problems)


def read_all(location: str | Path, *, include_journal: bool = True) -> pa.Table:
    """`scan_records`' table, its problems logged (for tests, live inspection and measuring against records)."""
    result = scan_records(location, include_journal=include_journal)
    for problem in result.problems:
        log.warning("%s", problem)
    return result.table


def last_seq_by_session(out_dir: str | Path,
                        on_unreadable: Callable[[Path, str], None] | None = None) -> dict[str, int]:
    """Highest `seq` per session among the gateway's shards and uncompacted journals in `out_dir` (so numbering
    continues after a restart, also past a journal whose compaction failed and is still to be retried).

    An unreadable shard is handed to `on_unreadable(path, reason)` (the gateway quarantines it) or logged, and
    never stops the count; nor does a journal row without a text `session_id` and an integer `seq`.
    """
    journals = read_live_journals(out_dir)  # before the shards are listed: see LiveJournals.uncompacted
    shards = sorted(Path(out_dir).glob(SHARD_GLOB))
    last: dict[str, int] = {}
    for shard in shards:
        try:
            table = pq.read_table(shard, schema=RECORD_SCHEMA, columns=["session_id", "seq"])
        except (OSError, pa.ArrowException) as exc:
            if on_unreadable is None:
                log.warning("skipping unreadable shard %s: %s", shard, one_line(exc))
            else:
                on_unreadable(shard, one_line(exc))
            continue
        grouped = table.group_by("session_id").aggregate([("seq", "max")])
        for session, seq in zip(grouped["session_id"].to_pylist(), grouped["seq_max"].to_pylist(), strict=True):
            _count(last, session, seq)
    for row in journals.uncompacted(shards)[0]:
        _count(last, row.get("session_id"), row.get("seq"))
    return last


def _count(last: dict[str, int], session: object, seq: object) -> None:
    if isinstance(session, str) and type(seq) is int:
        last[session] = max(seq, last.get(session, seq))
