"""The merged-sequence schema: one row per training sequence, defined once (Arrow schema + dataclass), versioned.

Produced by `polar-mitm merge` (per_request or prefix_merging), consumed by `polar-mitm grpo` and `polar-mitm sft`.
Invariants: `loss_mask[i] == 1` exactly where `input_ids[i]` is a token the model sampled, and there `logprobs[i]`
is the behaviour logprob recorded when it was sampled; everywhere else `logprobs[i] == 0.0`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

MERGED_SCHEMA_VERSION = 1

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
    schema_version: int = MERGED_SCHEMA_VERSION
    extra: dict = field(default_factory=dict, repr=False)  # not persisted

    def to_row(self) -> dict:
        row = {f: getattr(self, f) for f in MERGED_SCHEMA.names}
        return row
