"""Records and merged sequences as numpy arrays: the common currency of the builders, the invariants and merge.

A `TurnRecord` is the part of a per-request record (`polar_mitm.records.RECORD_SCHEMA`) that reconstruction
needs, with its token lists as numpy arrays (zero-copy views into Arrow buffers where possible). Builders take a
session's turns and return `MergedSequence`s whose `input_ids` / `loss_mask` / `logprobs` are numpy arrays;
`sequences_to_table` turns those into `MERGED_SCHEMA` rows without going through Python lists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from polar_mitm.storage.merged import (
    MERGED_SCHEMA,
    MERGED_SCHEMA_VERSION,
    SAMPLING_FIELDS,
    MergedSequence,
)
from polar_mitm.storage.records import version_spans_of
from polar_mitm.storage.session_ends import unparsed_tool_calls

# Why a record was left out of every sequence; merge reports these counts.
EXCLUDED_ERROR = "error"
EXCLUDED_ABORT = "abort"
EXCLUDED_DUPLICATE = "duplicate"
EXCLUDED_NO_PROMPT = "missing prompt ids"
EXCLUDED_NO_COMPLETION = "empty completion"
EXCLUDED_BAD_LOGPROBS = "logprobs missing or misaligned"
# Finish reasons whose records never become training data (their ids are partial or absent), with the reason merge
# reports for each.
EXCLUDED_FINISH_REASONS = {"error": EXCLUDED_ERROR, "abort": EXCLUDED_ABORT}

EMPTY_IDS = np.zeros(0, dtype=np.int32)
EMPTY_LOGPROBS = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One model call, as reconstruction sees it. `None` arrays mean the record had no list at all (null)."""

    request_id: str
    session_id: str
    seq: int
    finish_reason: str
    prompt_ids: np.ndarray | None  # int32
    completion_ids: np.ndarray | None  # int32
    completion_logprobs: np.ndarray | None  # float32
    task_id: str | None = None
    started_at: int = 0  # epoch microseconds: orders turns that share a seq
    weight_version: str | None = None
    error: str | None = None
    position: int = 0  # index in the input scan: the last tie-breaker, so ordering is total
    # The sampling parameters the engine used (record schema v2; None in v1 records: unknown).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    greedy: bool | None = None
    # The gateway (tokens mode) opened a new chain at this call (record `spliced_turns == 0`): it judged the
    # harness's history not to continue any sampled stream, so merge must not splice it either.
    new_chain: bool = False
    call_kind: str | None = None  # main | side | compaction (record schema v3; None before)
    constrained: bool | None = (
        None  # output was grammar-constrained (record `output_constraint`; None before v3)
    )
    # (start in completion_ids, weight version) per span of sampled tokens (record `version_spans`, schema v4);
    # None before v4: one span of `weight_version`.
    version_spans: tuple[tuple[int, str | None], ...] | None = None
    # The answer the harness got holds a tool call as text, one the parser could not read (storage/session_ends.py);
    # what decides, with finish_reason and error, how the session ended.
    unparsed_tool_call: bool = False

    def spans(self) -> list[tuple[int, str | None]]:
        """The turn's (start in completion_ids, version) spans: one of `weight_version` for older records."""
        return list(self.version_spans) if self.version_spans else [(0, self.weight_version)]

    def sort_key(self) -> tuple[int, int, str, int]:
        return (self.seq, self.started_at, self.request_id, self.position)

    def owned(self) -> TurnRecord:
        """A copy whose arrays own their memory (so a record outlives the Arrow batch it was read from)."""
        return replace(
            self,
            prompt_ids=None if self.prompt_ids is None else self.prompt_ids.copy(),
            completion_ids=None if self.completion_ids is None else self.completion_ids.copy(),
            completion_logprobs=None if self.completion_logprobs is None else self.completion_logprobs.copy(),
        )


def exclusion_reason(turn: TurnRecord) -> str | None:
    """Why `turn` cannot be trained on (None when it can). Never treats missing ids as empty ones."""
    if turn.finish_reason in EXCLUDED_FINISH_REASONS:
        return EXCLUDED_FINISH_REASONS[turn.finish_reason]
    if turn.prompt_ids is None or len(turn.prompt_ids) == 0:
        return EXCLUDED_NO_PROMPT
    # A call that sampled nothing has nothing to train; leaving it out also keeps every turn's mask-1 run
    # non-empty, so turn boundaries stay recoverable from the loss mask alone.
    if turn.completion_ids is None or len(turn.completion_ids) == 0:
        return EXCLUDED_NO_COMPLETION
    if turn.completion_logprobs is None or len(turn.completion_logprobs) != len(turn.completion_ids):
        return EXCLUDED_BAD_LOGPROBS
    if np.isnan(turn.completion_logprobs).any():
        return EXCLUDED_BAD_LOGPROBS
    return None


def prepare_session(turns: Iterable[TurnRecord]) -> tuple[list[TurnRecord], Counter[str]]:
    """Order a session's turns by (seq, started_at), drop duplicate request ids and untrainable records.

    Returns the trainable turns in order and the count of records left out, by reason.
    """
    excluded: Counter[str] = Counter()
    seen: set[str] = set()
    kept: list[TurnRecord] = []
    for turn in sorted(turns, key=TurnRecord.sort_key):
        if turn.request_id in seen:
            excluded[EXCLUDED_DUPLICATE] += 1
            continue
        seen.add(turn.request_id)
        reason = exclusion_reason(turn)
        if reason is not None:
            excluded[reason] += 1
            continue
        kept.append(turn)
    return kept, excluded


# -- Arrow → numpy -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListColumn:
    """A list<T> Arrow array as flat numpy values + offsets + validity; `row(i)` is a zero-copy view."""

    values: np.ndarray
    offsets: np.ndarray
    valid: np.ndarray  # bool per row: list present and free of null elements

    @classmethod
    def from_arrow(cls, array: pa.Array | pa.ChunkedArray, dtype: type[np.generic]) -> ListColumn:
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
        offsets = numpy_view(array.offsets, np.int32)
        child = array.values
        valid = np.ones(len(array), dtype=bool)
        if array.null_count:
            valid = ~array.is_null().to_numpy(zero_copy_only=False)
        if child.null_count:
            # Rows holding a null element are unusable; fill so the values stay a plain numeric array.
            null_before = np.concatenate([[0], np.cumsum(child.is_null().to_numpy(zero_copy_only=False))])
            valid &= null_before[offsets[1:]] == null_before[offsets[:-1]]
            child = pc.fill_null(child, pa.scalar(0, child.type))
        return cls(values=numpy_view(child, dtype), offsets=offsets, valid=valid)

    def row(self, i: int) -> np.ndarray | None:
        if not self.valid[i]:
            return None
        return self.values[self.offsets[i] : self.offsets[i + 1]]


def numpy_view(array: pa.Array, dtype: type[np.generic]) -> np.ndarray:
    """A primitive Arrow array as numpy (zero-copy when it has no nulls and the type already matches)."""
    return array.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _micros(column: pa.Array | pa.ChunkedArray) -> list[int]:
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.timestamp("us", tz=column.type.tz)).cast(pa.int64())
    return [0 if v is None else int(v) for v in column.to_pylist()]


def turns_from_table(table: pa.Table | pa.RecordBatch, *, first_position: int = 0) -> list[TurnRecord]:
    """Records (RECORD_SCHEMA columns; extra columns ignored) → TurnRecords with zero-copy array views."""
    n = table.num_rows
    if n == 0:
        return []
    names = set(table.schema.names)

    def strings(name: str) -> list[str | None]:
        return table.column(name).to_pylist() if name in names else [None] * n

    prompts = ListColumn.from_arrow(table.column("prompt_ids"), np.int32)
    completions = ListColumn.from_arrow(table.column("completion_ids"), np.int32)
    logprobs = ListColumn.from_arrow(table.column("completion_logprobs"), np.float32)
    started = _micros(table.column("started_at")) if "started_at" in names else [0] * n
    request_ids, session_ids, task_ids = strings("request_id"), strings("session_id"), strings("task_id")
    finish, versions, errors = strings("finish_reason"), strings("weight_version"), strings("error")
    seqs = table.column("seq").to_pylist()
    sampling = {name: strings(name) for name in SAMPLING_FIELDS}  # null in v1 records
    spliced = table.column("spliced_turns").to_pylist() if "spliced_turns" in names else [None] * n
    kinds = strings("call_kind")
    constraints = table.column("output_constraint").to_pylist() if "output_constraint" in names else None
    spans = table.column("version_spans").to_pylist() if "version_spans" in names else [None] * n
    unparsed = unparsed_tool_calls(table.column("response_json")) if "response_json" in names else [False] * n
    return [
        TurnRecord(
            request_id=request_ids[i],
            session_id=session_ids[i],
            seq=int(seqs[i]),
            finish_reason=finish[i] or "",
            prompt_ids=prompts.row(i),
            completion_ids=completions.row(i),
            completion_logprobs=logprobs.row(i),
            task_id=task_ids[i],
            started_at=started[i],
            weight_version=versions[i],
            error=errors[i],
            position=first_position + i,
            **{name: values[i] for name, values in sampling.items()},
            new_chain=spliced[i] == 0,
            call_kind=kinds[i],
            constrained=None if constraints is None else constraints[i] is not None,
            version_spans=tuple(version_spans_of(spans[i], versions[i])) if spans[i] else None,
            unparsed_tool_call=unparsed[i],
        )
        for i in range(n)
    ]


def sampling_columns(turns: Sequence[TurnRecord]) -> dict[str, list]:
    """The per-turn sampling columns of a sequence built from `turns` (MERGED_SCHEMA v3), in turn order."""
    columns = {column: [getattr(t, name) for t in turns] for name, column in SAMPLING_FIELDS.items()}
    columns["turn_constrained"] = [t.constrained for t in turns]
    return columns


def version_columns(turns: Sequence[TurnRecord], sampled_starts: Sequence[int]) -> dict[str, Any]:
    """The merged version columns of a sequence built from `turns` whose sampled ids begin at `sampled_starts` in
    input_ids (MERGED_SCHEMA v4): each span's absolute start and version, and the (min, max) over all spans."""
    starts: list[int] = []
    versions: list[str | None] = []
    for turn, at in zip(turns, sampled_starts, strict=True):
        n_sampled = 0 if turn.completion_ids is None else len(turn.completion_ids)
        for k, (start, version) in enumerate(turn.spans()):
            if k and not 0 < start < n_sampled:  # an empty span (a push after the last token) holds no token
                continue
            starts.append(at + (start if k else 0))
            versions.append(version)
    low, high = weight_version_range(versions)
    return {
        "span_starts": starts,
        "span_versions": versions,
        "weight_version_min": low,
        "weight_version_max": high,
    }


# -- merged sequences ⇄ Arrow ------------------------------------------------------------------------------------


def _list_array(parts: Sequence[np.ndarray], value_type: pa.DataType, dtype: type[np.generic]) -> pa.Array:
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:  # list<> has int32 offsets: the caller must write smaller batches
        raise ValueError(
            f"{offsets[-1]} tokens in one batch exceed Arrow list offsets; write smaller batches"
        )
    values = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=value_type))


def sequences_to_table(sequences: Sequence[MergedSequence]) -> pa.Table:
    """MergedSequences (numpy or list token fields) → a MERGED_SCHEMA table, vectorised over tokens."""
    arrays = {
        "schema_version": pa.array([MERGED_SCHEMA_VERSION] * len(sequences), pa.int16()),
        "input_ids": _list_array([np.asarray(s.input_ids) for s in sequences], pa.int32(), np.int32),
        "loss_mask": _list_array([np.asarray(s.loss_mask) for s in sequences], pa.int8(), np.int8),
        "logprobs": _list_array([np.asarray(s.logprobs) for s in sequences], pa.float32(), np.float32),
    }
    for field in MERGED_SCHEMA:
        if field.name not in arrays:
            arrays[field.name] = pa.array([getattr(s, field.name) for s in sequences], field.type)
    return pa.Table.from_arrays([arrays[f.name] for f in MERGED_SCHEMA], schema=MERGED_SCHEMA)


def sequences_from_table(table: pa.Table) -> list[MergedSequence]:
    """MERGED_SCHEMA rows → MergedSequences with numpy token fields (views into the table's buffers)."""
    if table.num_rows == 0:
        return []
    ids = ListColumn.from_arrow(table.column("input_ids"), np.int32)
    mask = ListColumn.from_arrow(table.column("loss_mask"), np.int8)
    lps = ListColumn.from_arrow(table.column("logprobs"), np.float32)
    scalars = {
        name: table.column(name).to_pylist()
        for name in MERGED_SCHEMA.names
        if name not in ("input_ids", "loss_mask", "logprobs") and name in table.schema.names
    }
    out = []
    for i in range(table.num_rows):
        row = {name: values[i] for name, values in scalars.items()}
        row.pop("schema_version", None)
        out.append(
            MergedSequence(
                input_ids=_or_empty(ids.row(i), EMPTY_IDS),
                loss_mask=_or_empty(mask.row(i), np.zeros(0, np.int8)),
                logprobs=_or_empty(lps.row(i), EMPTY_LOGPROBS),
                **row,
            )
        )
    return out


def _or_empty(values: np.ndarray | None, empty: np.ndarray) -> np.ndarray:
    return empty if values is None else values


@dataclass
class BuildResult:
    """What a builder returns for one session: its sequences (in first-turn order) and new-sequence causes."""

    sequences: list[MergedSequence]
    breaks: Counter[str]


def weight_version_range(versions: Iterable[str | None]) -> tuple[str | None, str | None]:
    """(min, max) of the turns' weight versions: numerically when all are integers, else as strings."""
    present = [v for v in versions if v is not None]
    if not present:
        return None, None
    if all(v.lstrip("-").isdigit() for v in present):
        return min(present, key=int), max(present, key=int)
    return min(present), max(present)
