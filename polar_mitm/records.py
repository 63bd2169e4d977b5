"""The per-request record: one row per model call, defined once (Arrow schema + dataclass) and versioned.

Other tools rely on the column names. Bump RECORD_SCHEMA_VERSION on any change and keep readers tolerant of
older versions (new nullable columns only). No I/O here: records are written and read by `polar_mitm/storage/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

# v2: sampling parameters used (temperature, top_p, top_k, min_p, greedy) and the prompt mode
# (prompt_mode, spliced_turns, splice_reason). v1 files read with those columns null.
# v3: call_kind (main|side|compaction) and output_constraint (json_schema|json_object|…); older files read null.
RECORD_SCHEMA_VERSION = 3

RECORD_SCHEMA = pa.schema([
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
    pa.field("harness_ids_json", pa.string()),  # harness-native session ids (Claude Code, Codex, opencode)
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
    pa.field("splice_reason", pa.string()),  # why the call did not continue a chain (tokens mode), if it did not
    # v3 — what the call was, as far as the gateway can tell (gateway/call_kind.py): main (the agent loop: tools
    # offered) | side (no tools: titles, classifiers, checks) | compaction (a harness summarising its history;
    # merge starts a new chain after it)
    pa.field("call_kind", pa.string()),
    # v3 — the engine decoded under a grammar (structured output): json_schema | json_object. Its logprobs are
    # of the masked distribution, not the model's own: training should leave such calls out (engine/constraints.py)
    pa.field("output_constraint", pa.string()),
], metadata={"polar_mitm.record_schema_version": str(RECORD_SCHEMA_VERSION)})

FINISH_REASONS = ("stop", "length", "tool_calls", "abort", "error")


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
        raise RecordError(f"{field.name}: {_first_line(exc)}: {_shown(values)}") from exc
    if not _fits(given.type, field.type):
        raise RecordError(f"{field.name} is {given.type}, expected {field.type}: {_shown(values)}")
    if not field.nullable and given.null_count:
        raise RecordError(f"{field.name} is missing or null (a required field)")
    if pa.types.is_list(given.type) and pc.list_flatten(given).null_count:
        raise RecordError(f"{field.name} holds a null")
    try:
        return given.cast(field.type)  # a safe cast: a value out of the column's range raises
    except (pa.ArrowException, OverflowError) as exc:
        raise RecordError(f"{field.name}: {_first_line(exc)}") from exc


def _shown(values: list[Any]) -> str:
    """The offending value for a message (a journal row is converted alone to find which is bad), cut short."""
    shown = repr(values[0] if len(values) == 1 else values)
    return shown[:60] + "…" if len(shown) > 60 else shown


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


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
