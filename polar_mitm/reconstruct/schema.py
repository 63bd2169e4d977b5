"""The merged-sequence schema: one row per training sequence, defined once (Arrow schema + dataclass), versioned.

Produced by `polar-mitm merge` (per_request or prefix_merging), consumed by `polar-mitm grpo` and `polar-mitm sft`.
Invariants: `loss_mask[i] == 1` exactly where `input_ids[i]` is a token the model sampled, and there `logprobs[i]`
is the behaviour logprob recorded when it was sampled; everywhere else `logprobs[i] == 0.0`.

v2 adds the sampling parameters of each merged call ("turn"), one list element per turn, with `turn_starts` (where
each turn's sampled ids begin in `input_ids`) mapping them onto tokens: turn k covers its sampled ids at
`turn_starts[k]` onward. Per turn rather than per token (a few numbers per call, not per token) and without
splitting sequences at a change (chains stay as merged; the trainer scales each token's logits by its own
turn's temperature). A null list (v1 files) or a null element (v1 records) means "unknown".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

# v2: per-turn sampling parameters (turn_starts, turn_temperature, turn_top_p, turn_top_k, turn_min_p, turn_greedy).
# v1 files read with those columns null. v3: turn_constrained (the call's output was grammar-constrained: its recorded
# logprobs are of the constrained, renormalised distribution); v2 files read it null.
MERGED_SCHEMA_VERSION = 3

MERGED_SCHEMA = pa.schema([
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
], metadata={"polar_mitm.merged_schema_version": str(MERGED_SCHEMA_VERSION)})


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
    schema_version: int = MERGED_SCHEMA_VERSION
    extra: dict = field(default_factory=dict, repr=False)  # not persisted

    def to_row(self) -> dict:
        row = {f: getattr(self, f) for f in MERGED_SCHEMA.names}
        return row


# The sampling parameters a record carries (records.RECORD_SCHEMA v2) and their per-turn merged columns.
SAMPLING_FIELDS = {"temperature": "turn_temperature", "top_p": "turn_top_p", "top_k": "turn_top_k",
                   "min_p": "turn_min_p", "greedy": "turn_greedy"}
