"""The merged sequence — one row per training sequence — and the merged store that writes and reads it.

The contract, defined once and versioned: `MERGED_SCHEMA` (Arrow) and `MergedSequence` (the typed row), with the
checks every reader makes (`validate_sequence`). Produced by `polar-mitm merge` (per_request or prefix_merging),
consumed by `polar-mitm grpo` and `polar-mitm sft`.
`end` is how the session ended (storage/session_ends.py) and `finish_reason` the engine's reason for its last turn.
Invariants: `loss_mask[i] == 1` exactly where `input_ids[i]` is a token the model sampled, and there `logprobs[i]`
is the behaviour logprob recorded when it was sampled; everywhere else `logprobs[i] == 0.0`.

v2 adds the sampling parameters of each merged call ("turn"), one list element per turn, with `turn_starts` (where
each turn's sampled ids begin in `input_ids`) mapping them onto tokens: turn k covers its sampled ids at
`turn_starts[k]` onward. Per turn rather than per token (a few numbers per call, not per token) and without
splitting sequences at a change (chains stay as merged; the trainer scales each token's logits by its own
turn's temperature). A null list (v1 files) or a null element (v1 records) means "unknown".

The store: `merged-NNNNN.parquet` shards (MERGED_SCHEMA rows) and `_summary.json`, written by `polar-mitm merge` and
read by `show`, `stats` and the trainers — local paths and pyarrow filesystem URIs alike. `read_merged` reads them
as one Arrow table; `MergedShards.sequences` as checked `MergedSequence`s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from polar_mitm.storage.location import InputNotFound, Location, StorageError, one_line, resolve_path
from polar_mitm.storage.session_ends import END_VALUES

if TYPE_CHECKING:
    import pyarrow.dataset as ds

# -- the contract ------------------------------------------------------------------------------------------------

# v2: per-turn sampling parameters (turn_starts, turn_temperature, turn_top_p, turn_top_k, turn_min_p, turn_greedy).
# v1 files read with those columns null. v3: turn_constrained (the call's output was grammar-constrained: its recorded
# logprobs are of the constrained, renormalised distribution); v2 files read it null.
# v4: span_starts + span_versions (the weight version of each contiguous span of sampled tokens, from the records'
# version_spans: a push may land between two tokens of a call); older files read null, which means one span from
# prompt_len of weight_version_min (`MergedSequence.version_spans`).
# v5: end (how the session ended, session_ends.SessionEnd: the same on every sequence of a session, which training
# rules act on); older files read null (not recorded), and `finish_reason` stays the engine's, of the last turn.
MERGED_SCHEMA_VERSION = 5

MERGED_SCHEMA = pa.schema(
    [
        pa.field("schema_version", pa.int16(), nullable=False),
        pa.field("sequence_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("task_id", pa.string()),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),  # tokens before the first sampled token
        pa.field("request_ids", pa.list_(pa.string()), nullable=False),  # the records merged, in order
        pa.field("n_turns", pa.int32(), nullable=False),
        pa.field("weight_version_min", pa.string()),
        pa.field("weight_version_max", pa.string()),
        pa.field("reward", pa.float64()),  # null until rewards are joined
        pa.field("builder", pa.string(), nullable=False),  # per_request | prefix_merging
        pa.field("finish_reason", pa.string()),  # of the last turn
        # v2 — per turn (in request_ids order): where its sampled ids start, and the sampling parameters the engine used
        # (from the records; behaviour logprobs are log_softmax(logits / temperature), before any truncation).
        pa.field("turn_starts", pa.list_(pa.int32())),
        pa.field("turn_temperature", pa.list_(pa.float32())),
        pa.field("turn_top_p", pa.list_(pa.float32())),
        pa.field("turn_top_k", pa.list_(pa.int32())),  # -1 = off
        pa.field("turn_min_p", pa.list_(pa.float32())),
        pa.field("turn_greedy", pa.list_(pa.bool_())),
        pa.field("turn_constrained", pa.list_(pa.bool_())),
        # v4 — per span of sampled tokens under one weight version: where it starts in input_ids (increasing, the
        # first at or before the first sampled token) and the version; a span runs to the next span's start.
        pa.field("span_starts", pa.list_(pa.int32())),
        pa.field("span_versions", pa.list_(pa.string())),
        # v5 — how the session ended (session_ends.SessionEnd), the same on each of its sequences.
        pa.field("end", pa.string()),
    ],
    metadata={"polar_mitm.merged_schema_version": str(MERGED_SCHEMA_VERSION)},
)


@dataclass
class MergedSequence:
    sequence_id: str
    session_id: str
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_len: int
    request_ids: list[str]
    n_turns: int
    builder: str
    task_id: str | None = None
    weight_version_min: str | None = None
    weight_version_max: str | None = None
    reward: float | None = None
    finish_reason: str | None = None
    turn_starts: list[int] | None = None
    turn_temperature: list[float | None] | None = None
    turn_top_p: list[float | None] | None = None
    turn_top_k: list[int | None] | None = None
    turn_min_p: list[float | None] | None = None
    turn_greedy: list[bool | None] | None = None
    turn_constrained: list[bool | None] | None = None
    span_starts: list[int] | None = None
    span_versions: list[str | None] | None = None
    end: str | None = None
    schema_version: int = MERGED_SCHEMA_VERSION
    extra: dict = field(default_factory=dict, repr=False)  # not persisted

    def to_row(self) -> dict:
        row = {f: getattr(self, f) for f in MERGED_SCHEMA.names}
        return row

    def version_spans(self) -> list[tuple[int, str | None]]:
        """(start in input_ids, weight version) per span of sampled tokens; a sequence merged before v4 is one
        span from `prompt_len` of `weight_version_min` (the oldest version any of its calls reported)."""
        if self.span_starts is None or self.span_versions is None or len(self.span_starts) == 0:
            return [(self.prompt_len, self.weight_version_min)]
        return [(int(s), v) for s, v in zip(self.span_starts, self.span_versions, strict=True)]


# The sampling parameters a record carries (records.RECORD_SCHEMA v2) and their per-turn merged columns.
SAMPLING_FIELDS = {
    "temperature": "turn_temperature",
    "top_p": "turn_top_p",
    "top_k": "turn_top_k",
    "min_p": "turn_min_p",
    "greedy": "turn_greedy",
}


class MergedDataError(ValueError):
    """Merged shards that break MERGED_SCHEMA's invariants (and so cannot be trained on safely)."""


def validate_sequence(seq: MergedSequence, *, where: str = "") -> None:
    """Raise `MergedDataError` unless ids, mask and logprobs align and the logprobs are usable as ratios."""
    at = f"{where}: sequence {seq.sequence_id}" if where else f"sequence {seq.sequence_id}"
    n = len(seq.input_ids)
    if not (len(seq.loss_mask) == len(seq.logprobs) == n):
        raise MergedDataError(
            f"{at}: input_ids/loss_mask/logprobs lengths differ "
            f"({n}/{len(seq.loss_mask)}/{len(seq.logprobs)})"
        )
    if not 1 <= seq.prompt_len <= n:
        raise MergedDataError(f"{at}: prompt_len={seq.prompt_len} outside [1, {n}]")
    if any(seq.loss_mask[: seq.prompt_len]):
        raise MergedDataError(
            f"{at}: a sampled token (loss_mask 1) inside the prompt (prompt_len={seq.prompt_len})"
        )
    mask = np.asarray(seq.loss_mask)
    logprobs = np.asarray(seq.logprobs, dtype=np.float64)
    bad_mask = np.flatnonzero((mask != 0) & (mask != 1))
    if bad_mask.size:
        i = int(bad_mask[0])
        raise MergedDataError(f"{at}: loss_mask[{i}]={seq.loss_mask[i]} is not 0/1")
    if seq.turn_starts is not None:
        starts = list(seq.turn_starts)
        if starts != sorted(starts) or not all(seq.prompt_len <= s < n for s in starts):
            raise MergedDataError(f"{at}: turn_starts {starts[:8]} not increasing within [prompt_len, {n})")
        for name in (
            "turn_temperature",
            "turn_top_p",
            "turn_top_k",
            "turn_min_p",
            "turn_greedy",
            "turn_constrained",
        ):
            values = getattr(seq, name)
            if values is not None and len(values) != len(starts):
                raise MergedDataError(f"{at}: {name} has {len(values)} values for {len(starts)} turns")
    if seq.span_starts is not None:
        spans = [int(s) for s in seq.span_starts]
        if seq.span_versions is None or len(seq.span_versions) != len(spans):
            raise MergedDataError(f"{at}: span_starts and span_versions differ in length")
        if any(b <= a for a, b in zip(spans, spans[1:], strict=False)) or not all(
            seq.prompt_len <= s < n for s in spans
        ):
            raise MergedDataError(f"{at}: span_starts {spans[:8]} not increasing within [prompt_len, {n})")
    if seq.end is not None and seq.end not in END_VALUES:
        raise MergedDataError(f"{at}: end {seq.end!r} is none of {', '.join(END_VALUES)}")
    sampled = mask == 1
    bad_logprob = np.flatnonzero(sampled & ~(np.isfinite(logprobs) & (logprobs <= 1e-6)))
    if bad_logprob.size:
        i = int(bad_logprob[0])
        raise MergedDataError(f"{at}: logprob[{i}]={seq.logprobs[i]} is not a finite log-probability")


def sequences_in(table: pa.Table, where: str) -> Iterator[MergedSequence]:
    """A merged shard's rows as checked `MergedSequence`s; raises `MergedDataError` naming `where` (the file)."""
    missing = {"input_ids", "loss_mask", "logprobs", "session_id"} - set(table.column_names)
    if missing:
        raise MergedDataError(f"{where}: not a merged shard (missing columns {sorted(missing)})")
    names = {f.name for f in MERGED_SCHEMA}
    for row in table.to_pylist():
        version = row.get("schema_version") or MERGED_SCHEMA_VERSION
        if version > MERGED_SCHEMA_VERSION:
            raise MergedDataError(
                f"{where}: merged schema v{version} is newer than this reader (v{MERGED_SCHEMA_VERSION})"
            )
        seq = MergedSequence(**{k: v for k, v in row.items() if k in names})
        validate_sequence(seq, where=where)
        yield seq


# -- the store ---------------------------------------------------------------------------------------------------


# zstd, and dictionaries only where values repeat: token ids span the vocabulary, so a dictionary page
# overflows and costs time for nothing (measured: ~40% faster writes, reads no slower).
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "use_dictionary": [
        "session_id",
        "task_id",
        "builder",
        "finish_reason",
        "end",
        "weight_version_min",
        "weight_version_max",
        "loss_mask",
    ],
}
SHARD_PREFIX = "merged-"
SUMMARY_FILE = "_summary.json"  # leading underscore: Parquet dataset readers skip it


class ShardWriter:
    """Writes tables of merged rows as `merged-NNNNN.parquet` shards (temp file + rename, never half-written)."""

    def __init__(self, output: str) -> None:
        self.fs, self.root = resolve_path(output)
        if self.fs.get_file_info(self.root).type == pafs.FileType.File:
            raise StorageError(f"output {output}: is a file, not a folder")
        try:
            self.fs.create_dir(self.root, recursive=True)
        except (OSError, pa.ArrowException) as exc:
            raise StorageError(f"output {output}: cannot create the folder ({one_line(exc)})") from exc
        # A re-run replaces the previous output instead of mixing with it.
        for info in self.fs.get_file_info(pafs.FileSelector(self.root)):
            name = info.base_name
            if name == SUMMARY_FILE or (name.startswith(SHARD_PREFIX) and name.endswith(".parquet")):
                self.fs.delete_file(info.path)
        self.shards: list[str] = []

    def write(self, table: pa.Table) -> None:
        name = f"{SHARD_PREFIX}{len(self.shards):05d}.parquet"
        temp, final = f"{self.root}/.{name}.tmp", f"{self.root}/{name}"
        pq.write_table(table, temp, filesystem=self.fs, **PARQUET_OPTIONS)
        self.fs.move(temp, final)
        self.shards.append(final)

    def write_summary(self, summary: dict[str, Any]) -> None:
        with self.fs.open_output_stream(f"{self.root}/{SUMMARY_FILE}") as out:
            out.write(json.dumps(summary, indent=2).encode())


@dataclass
class MergedShards:
    """The merged shards at a location: a shard file, or every shard under a folder."""

    filesystem: pafs.FileSystem
    files: list[str]

    @classmethod
    def at(cls, location: str | Path) -> MergedShards:
        """Raises FileNotFoundError when nothing is at `location` or no shard is under it."""
        where = Location.of(location)
        if not where.exists:
            raise InputNotFound(f"no merged shards at {location}")
        files = (
            where.parquet_files()
        )  # only the shards: the folder also holds _summary.json and, after `stats`, a PNG
        if not files:
            raise InputNotFound(f"no merged shards under {location}")
        return cls(where.filesystem, files)

    def dataset(self) -> ds.Dataset:
        """The shards as one pyarrow dataset; a file that is not a readable Parquet shard (cut short, or not
        ours) raises `MergedDataError` naming it, instead of pyarrow's error about the whole list."""
        # Imported here: pyarrow.dataset imports pandas (~0.4 s), which every process importing this module (each
        # CLI command, each gateway) would pay at start for nothing.
        import pyarrow.dataset as ds

        try:
            return ds.dataset(self.files, format="parquet", filesystem=self.filesystem)
        except (OSError, pa.ArrowException) as exc:
            raise MergedDataError(self._unreadable(exc)) from exc

    def table(self, columns: list[str] | None = None, filter_expr: Any = None) -> pa.Table:
        """Every shard as one table (`columns` and `filter_expr` pushed down to the Parquet reader)."""
        dataset = self.dataset()
        try:
            return dataset.to_table(columns=columns, filter=filter_expr)
        except (OSError, pa.ArrowException) as exc:
            raise MergedDataError(self._unreadable(exc)) from exc

    def _unreadable(self, exc: BaseException) -> str:
        for file in self.files:  # which one: pyarrow's message names the list's first failure, or none
            try:
                pq.read_metadata(file, filesystem=self.filesystem)
            except (OSError, pa.ArrowException) as bad:
                return (
                    f"{file}: not a readable merged shard ({one_line(bad)}); "
                    "remove it or run `polar-mitm merge` again"
                )
        return f"merged shards {self.files[0]}…: unreadable ({one_line(exc)})"

    def tables(self) -> Iterator[tuple[str, pa.Table]]:
        """Each shard whole, with its name (for errors that name the file)."""
        for file in self.files:
            yield file, MergedShards(self.filesystem, [file]).table()

    def sequences(self) -> Iterator[MergedSequence]:
        """Every row, shard by shard, as a checked `MergedSequence` (raises `MergedDataError` naming the shard)."""
        for file, table in self.tables():
            yield from sequences_in(table, file)


def read_merged(location: str | Path, columns: list[str] | None = None, filter_expr: Any = None) -> pa.Table:
    """The merged shards at `location` (a folder, a shard, or a URI of either) as one table."""
    return MergedShards.at(location).table(columns, filter_expr)
