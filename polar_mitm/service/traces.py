"""A finished session's trajectory: its records merged (`prefix_merging`, or one trace per call with `per_request`)
exactly as `polar-mitm merge` would, each sequence split at its prompt into Polar's `Trace` — and back.

`prompt_ids` are the first call's prompt, `response_ids` everything after it: sampled tokens (loss mask 1, their
recorded logprobs) and, between calls, the context the harness added (tool outputs, the next prompt's new part:
mask 0, logprob 0.0). A trace's `finish_reason` is how its session ended, in the vocabulary of
`storage/session_ends.py` (completed, length, context_overflow, unparsed_tool_call, harness_timeout, harness_crash,
engine_error, cut, cancelled: the session's runner status, when given, and its last call), the same on each of its
traces; the engine's own reason for the trace's last call is `metadata["engine_finish_reason"]`. A trace's metadata
says which weight versions sampled it (per call too) and at what temperature; it also carries the rest of the merged row (`MERGED_METADATA`: ids, per-turn sampling
parameters), so `merged_sequence` gives back the very row `polar-mitm merge` writes — what a trainer of ours
(`polar-mitm loop --service`) trains on, with no record in reach.
"""

from __future__ import annotations

from pathlib import Path

from polar_mitm.reconstruct.merge import merge_table, recorded_eot
from polar_mitm.service.models import Trace
from polar_mitm.storage.merged import MergedSequence, sequences_in
from polar_mitm.storage.rewards import Reward
from polar_mitm.storage.session_records import read_live_session

# The merged row's fields a trace's metadata carries as they are (the ids, mask and logprobs are the trace's own).
MERGED_METADATA = (
    "sequence_id",
    "session_id",
    "task_id",
    "builder",
    "request_ids",
    "n_turns",
    "weight_version_min",
    "weight_version_max",
    "turn_starts",
    "turn_temperature",
    "turn_top_p",
    "turn_top_k",
    "turn_min_p",
    "turn_greedy",
    "turn_constrained",
    "span_starts",
    "span_versions",
    "end",
)


def session_traces(
    flows: Path,
    session_id: str,
    reward: float | None,
    builder: str,
    eot_token_id: int | None,
    status: str | None = None,
) -> list[Trace]:
    """The traces of `session_id`'s records under `flows` (live journals included), rewarded `reward`; `status`:
    the runner's, for how the session ended (without it, its calls alone say)."""
    mine = read_live_session(flows, session_id)  # at the cost of what the folder gained since the last one
    if mine.num_rows == 0:
        return []
    said = None if status is None else {session_id: Reward(reward, status=status)}
    table, _ = merge_table(mine, builder=builder, eot_token_id=eot_token_id, rewards=said, check=True)
    versions = dict(
        zip(mine.column("request_id").to_pylist(), mine.column("weight_version").to_pylist(), strict=True)
    )
    return [_trace(seq, reward, versions) for seq in sequences_in(table, f"session {session_id}")]


def flows_eot(flows: Path) -> int | None:
    """The end-of-turn id the gateway recorded for its engine (None before its first call)."""
    found = recorded_eot([str(flows)])
    return found[0] if found else None


def _trace(seq: MergedSequence, reward: float | None, versions: dict[str, str | None]) -> Trace:
    cut = seq.prompt_len
    mask = [int(m) for m in seq.loss_mask[cut:]]
    logprobs = [float(lp) if m else 0.0 for lp, m in zip(seq.logprobs[cut:], mask, strict=True)]
    temperatures = sorted({t for t in (seq.turn_temperature or []) if t is not None})
    metadata = {name: _plain(getattr(seq, name)) for name in MERGED_METADATA}
    return Trace(
        prompt_ids=list(seq.input_ids[:cut]),
        response_ids=list(seq.input_ids[cut:]),
        loss_mask=mask,
        response_logprobs=logprobs,
        finish_reason=seq.end,
        reward=reward,
        metadata={
            **metadata,
            "engine_finish_reason": seq.finish_reason,  # the engine's, for the trace's last call
            # each merged call's weight version, in request_ids order (staleness per call)
            "request_weight_versions": [versions.get(r) for r in seq.request_ids],
            "temperature": temperatures[0] if len(temperatures) == 1 else temperatures or None,
        },
    )


def merged_sequence(trace: Trace) -> MergedSequence:
    """The merged row a trace was cut from (`polar-mitm merge`'s, reward included); a trace of another service
    lacks the metadata: KeyError names the field."""
    meta = trace.metadata
    # a trace of before ends were recorded: no `end`, and its finish_reason was the engine's
    fields = {name: meta[name] if name != "end" else meta.get("end") for name in MERGED_METADATA}
    logprobs = [0.0] * len(trace.prompt_ids) + list(
        trace.response_logprobs or [0.0] * len(trace.response_ids)
    )
    return MergedSequence(
        input_ids=list(trace.prompt_ids) + list(trace.response_ids),
        loss_mask=[0] * len(trace.prompt_ids) + list(trace.loss_mask),
        logprobs=logprobs,
        prompt_len=len(trace.prompt_ids),
        reward=trace.reward,
        finish_reason=meta["engine_finish_reason"] if "end" in meta else trace.finish_reason,
        **fields,
    )


def _plain(value):
    """Lists as lists (a merged row's list column may come as a tuple)."""
    return list(value) if isinstance(value, list | tuple) else value
