"""The per-request record — one row per model call — and the one reader of the records store.

The contract, defined once and versioned: `RECORD_SCHEMA` (Arrow) and `Record` (the typed row), with the strict
conversion of journal rows into a `RECORD_SCHEMA` table (`journal_rows_to_table`, `records_table`). Other tools rely
on the column names. Bump RECORD_SCHEMA_VERSION on any change and keep readers tolerant of older versions (new
nullable columns only). Records are written by `storage/journal.py` (the durable journal and its shards).

The reader, for every consumer, local or under any pyarrow filesystem URI: `list_sources` lists the inputs (record
Parquet files, and the records still in the live journals of a local folder and of every records folder under it:
`gw-K` of `--gateways N`, Ray's `node-*`, a dead gateway's included) and `merge` streams them; `scan_records` /
`read_all` read them whole. A live journal is read *before* its folder is listed and a journal whose shard is listed
is left out (`storage/journal_format.py`), so a compaction running meanwhile can neither hide a record nor show it
twice. A record is its `request_id`: a frame written twice is one record. Unreadable parts are skipped, one line
each, and never stop the rest.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from polar_mitm.storage.journal_format import JOURNAL_DIR, SHARD_GLOB, LiveJournals, read_live_journals
from polar_mitm.storage.location import Location, StorageError, one_line

log = logging.getLogger(__name__)


# -- the contract ------------------------------------------------------------------------------------------------

# v2: sampling parameters used (temperature, top_p, top_k, min_p, greedy) and the prompt mode
# (prompt_mode, spliced_turns, splice_reason). v1 files read with those columns null.
# v3: call_kind (main|side|compaction) and output_constraint (json_schema|json_object|…); older files read null.
# v4: version_spans (the weight version of each contiguous span of sampled tokens: a push may land mid-call);
# older files read null, which means one span at 0 of the record's weight_version (`version_spans_of`).
RECORD_SCHEMA_VERSION = 4

# One span of sampled tokens under one weight version: `start` indexes completion_ids; the span runs to the next
# span's start (or the end).
VERSION_SPAN_TYPE = pa.struct([pa.field("start", pa.int32()), pa.field("version", pa.string())])

RECORD_SCHEMA = pa.schema(
    [
        pa.field("schema_version", pa.int16(), nullable=False),
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("task_id", pa.string()),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("started_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("finished_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("provider", pa.string(), nullable=False),
        pa.field("path", pa.string(), nullable=False),
        pa.field("host", pa.string()),
        pa.field("mode", pa.string()),  # regular (HTTPS_PROXY) | reverse (base URL)
        pa.field("stream", pa.bool_(), nullable=False),
        pa.field("model_requested", pa.string()),
        pa.field("model_used", pa.string()),
        pa.field("request_json", pa.string()),  # provider-native body, secrets removed
        pa.field("messages_json", pa.string()),  # the internal conversation the engine was asked
        pa.field("tools_json", pa.string()),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("completion_ids", pa.list_(pa.int32())),
        pa.field("completion_logprobs", pa.list_(pa.float32())),
        pa.field("finish_reason", pa.string(), nullable=False),  # stop|length|tool_calls|abort|error
        pa.field("response_json", pa.string()),  # provider-native answer (the non-streamed form for streams)
        pa.field("weight_version", pa.string()),
        pa.field("error", pa.string()),
        pa.field("status_code", pa.int32()),
        pa.field("session_source", pa.string()),  # header|proxy_auth|path|api_key|connection
        pa.field(
            "harness_ids_json", pa.string()
        ),  # harness-native session ids (Claude Code, Codex, opencode)
        pa.field("engine_meta_json", pa.string()),  # engine timings, cached tokens, matched stop, ...
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        # v2 — the sampling parameters the engine was sent (the gateway always sends them explicitly, so these are
        # what it sampled with); behaviour logprobs are log_softmax(logits / temperature).
        pa.field("temperature", pa.float32()),
        pa.field("top_p", pa.float32()),
        pa.field("top_k", pa.int32()),  # -1 = off
        pa.field("min_p", pa.float32()),
        pa.field("greedy", pa.bool_()),  # temperature ≈ 0: logprobs are not the sampling distribution's
        # v2 — how the prompt reached the engine: tokens (spliced token stream) | messages (engine rendered them)
        pa.field("prompt_mode", pa.string()),
        pa.field("spliced_turns", pa.int32()),  # earlier sampled turns carried verbatim in prompt_ids
        pa.field(
            "splice_reason", pa.string()
        ),  # why the call did not continue a chain (tokens mode), if it did not
        # v3 — what the call was, as far as the gateway can tell (gateway/call_kind.py): main (the agent loop: tools
        # offered) | side (no tools: titles, classifiers, checks) | compaction (a harness summarising its history;
        # merge starts a new chain after it)
        pa.field("call_kind", pa.string()),
        # v3 — the engine decoded under a grammar (structured output): json_schema | json_object. Its logprobs are
        # of the masked distribution, not the model's own: training should leave such calls out (engine/constraints.py)
        pa.field("output_constraint", pa.string()),
        # v4 — the weight version per contiguous span of completion_ids, in order, the first at 0 (null: one span,
        # `weight_version`). The engine swapped weights between two tokens of the call where there are several.
        pa.field("version_spans", pa.list_(VERSION_SPAN_TYPE)),
    ],
    metadata={"polar_mitm.record_schema_version": str(RECORD_SCHEMA_VERSION)},
)


@dataclass
class Record:
    request_id: str
    session_id: str
    seq: int
    started_at: datetime
    finished_at: datetime
    provider: str
    path: str
    stream: bool
    finish_reason: str
    task_id: str | None = None
    host: str | None = None
    mode: str | None = None
    model_requested: str | None = None
    model_used: str | None = None
    request_json: str | None = None
    messages_json: str | None = None
    tools_json: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    response_json: str | None = None
    weight_version: str | None = None
    error: str | None = None
    status_code: int | None = None
    session_source: str | None = None
    harness_ids_json: str | None = None
    engine_meta_json: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    greedy: bool | None = None
    prompt_mode: str | None = None
    spliced_turns: int | None = None
    splice_reason: str | None = None
    call_kind: str | None = None
    output_constraint: str | None = None
    version_spans: list[dict[str, Any]] | None = None  # [{"start": int, "version": str | None}, ...]
    schema_version: int = RECORD_SCHEMA_VERSION

    def to_journal(self) -> dict[str, Any]:
        """A JSON-safe dict (timestamps as epoch microseconds) for the durable journal."""
        row = {f.name: getattr(self, f.name) for f in fields(self)}  # shallow: no copy of long id lists
        row["started_at"] = to_micros(self.started_at)
        row["finished_at"] = to_micros(self.finished_at)
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Record:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names})


def version_spans_of(
    spans: Sequence[dict[str, Any]] | None, weight_version: str | None
) -> list[tuple[int, str | None]]:
    """A record's (start, version) spans over its completion_ids; a record without spans (schema < 4, or an engine
    that reports none) is one span at 0 of its `weight_version`."""
    if not spans:
        return [(0, weight_version)]
    return [(int(span["start"]), span.get("version")) for span in spans]


def spans_from_pairs(pairs: Sequence[tuple[int, str | None]]) -> list[dict[str, Any]] | None:
    """(start, version) pairs as the record's `version_spans` value (None for none)."""
    return [{"start": int(start), "version": version} for start, version in pairs] or None


def to_micros(ts: datetime) -> int:
    return int(ts.timestamp() * 1_000_000)


def from_micros(us: int) -> datetime:
    return datetime.fromtimestamp(us / 1_000_000, tz=UTC)


class RecordError(ValueError):
    """A journal row that is not a record: a required field missing or null, or a value of the wrong type."""


def _fits(given: pa.DataType, wanted: pa.DataType) -> bool:
    """Whether values Python gave as `given` may become `wanted` (no float truncated to an int, no text parsed)."""
    if pa.types.is_null(given):
        return True
    if pa.types.is_list(wanted):
        return pa.types.is_list(given) and _fits(given.value_type, wanted.value_type)
    if pa.types.is_struct(wanted):
        if not pa.types.is_struct(given):
            return False
        have = {given.field(i).name: given.field(i).type for i in range(given.num_fields)}
        return set(have) <= {f.name for f in wanted} and all(
            _fits(have.get(f.name, pa.null()), f.type) for f in wanted
        )
    if pa.types.is_integer(wanted) or pa.types.is_timestamp(wanted):  # timestamps are epoch microseconds
        return pa.types.is_integer(given)
    if pa.types.is_floating(wanted):
        return pa.types.is_integer(given) or pa.types.is_floating(given)
    return given == wanted  # string, bool


def _column(field: pa.Field, values: list[Any]) -> pa.Array:
    """One RECORD_SCHEMA column from the journal's values, checked strictly; raises RecordError naming the field."""
    try:
        given = pa.array(values)  # the types the values have, before anything is converted
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise RecordError(f"{field.name}: {one_line(exc)}: {_shown(values)}") from exc
    if not _fits(given.type, field.type):
        raise RecordError(f"{field.name} is {given.type}, expected {field.type}: {_shown(values)}")
    if not field.nullable and given.null_count:
        raise RecordError(f"{field.name} is missing or null (a required field)")
    if pa.types.is_list(given.type) and pc.list_flatten(given).null_count:
        raise RecordError(f"{field.name} holds a null")
    try:
        return given.cast(field.type)  # a safe cast: a value out of the column's range raises
    except (pa.ArrowException, OverflowError) as exc:
        raise RecordError(f"{field.name}: {one_line(exc)}") from exc


def _shown(values: list[Any]) -> str:
    """The offending value for a message (a journal row is converted alone to find which is bad), cut short."""
    shown = repr(values[0] if len(values) == 1 else values)
    return shown[:60] + "…" if len(shown) > 60 else shown


def journal_rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Journal dicts → an Arrow table with RECORD_SCHEMA (timestamps from epoch microseconds).

    Strict, because a shard must be writable and readable by every consumer: a required field missing or null,
    a value of another type (a float seq, a string id list, a bool status) or out of range raises RecordError.
    Keys that are not record fields are ignored.
    """
    for row in rows:
        if not isinstance(row, dict):
            raise RecordError(f"not a record: a JSON {type(row).__name__}, not an object")
    arrays = [_column(field, [row.get(field.name) for row in rows]) for field in RECORD_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=RECORD_SCHEMA)


def distinct_rows(rows: list[Any]) -> tuple[list[Any], list[tuple[dict[str, Any], str]]]:
    """`rows` with each `request_id` once (the first), and the later rows that reuse an id with other contents.

    A frame written twice (a retried append, a journal copied into another) is the same record: once is enough.
    A different row under a taken id cannot be a second record (every reader keys calls by it), so it is set
    aside with why. Rows that are not dicts, or have no text id, pass through for `records_table` to judge.
    """
    first: dict[str, dict[str, Any]] = {}
    kept: list[Any] = []
    rejected: list[tuple[dict[str, Any], str]] = []
    for row in rows:
        request_id = row.get("request_id") if isinstance(row, dict) else None
        if not isinstance(request_id, str):
            kept.append(row)
        elif request_id not in first:
            first[request_id] = row
            kept.append(row)
        elif row != first[request_id]:
            rejected.append((row, f"request_id {request_id!r} is taken by an earlier, different record"))
    return kept, rejected


def records_table(rows: list[dict[str, Any]]) -> tuple[pa.Table, list[tuple[dict[str, Any], str]]]:
    """Journal dicts → (a RECORD_SCHEMA table of the good rows, the rows that cannot be records with why).

    Each `request_id` once (`distinct_rows`). One bad row (a token id beyond int32, a missing field, a string
    where a number goes) must not keep the others out of a shard, so on failure each row is converted alone to
    find the bad ones.
    """
    rows, rejected = distinct_rows(rows)
    try:
        return journal_rows_to_table(rows), rejected
    except Exception:  # which row, and why, is found below
        pass
    good: list[pa.Table] = []
    for row in rows:
        try:
            good.append(journal_rows_to_table([row]))
        except Exception as exc:  # any conversion failure makes this one row unusable, nothing more
            rejected.append((row, f"{type(exc).__name__}: {one_line(exc)}"))
    return (pa.concat_tables(good) if good else RECORD_SCHEMA.empty_table()), rejected


# -- the reader --------------------------------------------------------------------------------------------------


# The columns a reader of records needs, and those it uses when present (older versions lack some).
REQUIRED_COLUMNS = (
    "request_id",
    "session_id",
    "seq",
    "finish_reason",
    "prompt_ids",
    "completion_ids",
    "completion_logprobs",
)
OPTIONAL_COLUMNS = (
    "task_id",
    "started_at",
    "weight_version",
    "error",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "greedy",
    "spliced_turns",
    "call_kind",
    "output_constraint",
    "version_spans",
    "response_json",  # the answer the harness got: a tool call left in it as text was not parsed (session_ends.py)
)


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
    **{
        name: (_is_text, "text")
        for name in (
            "request_id",
            "session_id",
            "task_id",
            "finish_reason",
            "weight_version",
            "error",
            "response_json",
        )
    },
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
    skipped: list[
        str
    ]  # other Parquet files (e.g. merged shards): skipped, as pyarrow datasets skip foreign files
    problems: list[str]  # one line each: a file, and why it was skipped or how it was read


def add_parquet_source(file: str, fs: pafs.FileSystem, inputs: Inputs) -> None:
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
    """Every records Parquet file under `inputs` (files or folders, sorted), plus the live journals of a local
    folder and of every records folder below it (`journal_folders`).

    Files whose columns are not records (e.g. merged shards) are skipped and named in `skipped`; unreadable files
    and columns of the wrong type are skipped with a line in `problems`. Names starting with `_` or `.` are
    skipped, as pyarrow datasets do. Live journals are read *before* the folder is listed, and a journal whose
    shard is listed is left out, so a compaction running meanwhile neither hides nor doubles a record.
    """
    found = Inputs(sources=[], skipped=[], problems=[])
    for uri in inputs:
        where = Location.of(uri)
        if not where.exists:
            raise StorageError(f"{uri}: no such file or folder")
        journals = (
            [(folder, read_live_journals(folder)) for folder in journal_folders(Path(where.path))]
            if include_journal and where.is_local_folder
            else []
        )
        files = where.parquet_files()  # after the journals: see the docstring
        for file in files:
            add_parquet_source(file, where.filesystem, found)
        for folder, live in journals:
            journal = _journal_source(folder, live, files, found)
            if journal is not None:
                found.sources.append(journal)
    return found


def journal_folders(root: Path) -> list[Path]:
    """`root` and every folder below it that holds a live journal (`_journal/`): each of `--gateways N`'s `gw-K`,
    each Ray node's `node-*`, at any depth (a run's `iter-K/flows/gw-K`). Names starting with `_` or `.` are not
    entered, as for shards; a folder that cannot be listed is left out here and named by the Parquet listing."""
    folders = [root]
    for parent, children, _ in os.walk(root, onerror=lambda exc: None):
        if Path(parent) != root and JOURNAL_DIR in children:
            folders.append(Path(parent))
        children[:] = sorted(name for name in children if name[:1] not in "_.")
    return folders


def _journal_source(folder: Path, journals: LiveJournals, files: list[str], found: Inputs) -> Source | None:
    """Records still in the gateway's live journal (acknowledged, not yet compacted into one of `files`)."""
    rows, problems = journals.uncompacted(files)
    found.problems.extend(problems)
    if not rows:
        return None
    table, rejected = records_table(rows)
    for row, reason in rejected:
        found.problems.append(
            f"{folder / JOURNAL_DIR}: row of request {str(row.get('request_id'))!r} skipped: {reason}"
        )
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


def read_session(location: str | Path, session_id: str) -> pa.Table:
    """One session's records at `location` (shards and live journals), each shard read with a filter on
    `session_id` (its row groups' statistics skip the rest): what the rollout service reads as each session ends,
    while the folder grows."""
    if not Location.of(location).exists:
        return RECORD_SCHEMA.empty_table()
    tables = []
    for source in list_sources([location]).sources:
        if source.table is not None:
            tables.append(source.table.filter(pc.equal(source.table["session_id"], session_id)))
            continue
        try:
            tables.append(
                pq.read_table(
                    source.name,
                    filesystem=source.filesystem,
                    schema=RECORD_SCHEMA,
                    filters=[("session_id", "==", session_id)],
                )
            )
        except (OSError, pa.ArrowException) as exc:
            log.warning("%s: unreadable (%s), skipped", source.name, one_line(exc))
    tables = [t for t in tables if t.num_rows]
    return pa.concat_tables(tables) if tables else RECORD_SCHEMA.empty_table()


def last_seq_by_session(
    out_dir: str | Path, on_unreadable: Callable[[Path, str], None] | None = None
) -> dict[str, int]:
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
        for session, seq in zip(
            grouped["session_id"].to_pylist(), grouped["seq_max"].to_pylist(), strict=True
        ):
            _count(last, session, seq)
    for row in journals.uncompacted(shards)[0]:
        _count(last, row.get("session_id"), row.get("seq"))
    return last


def _count(last: dict[str, int], session: object, seq: object) -> None:
    if isinstance(session, str) and type(seq) is int:
        last[session] = max(seq, last.get(session, seq))
