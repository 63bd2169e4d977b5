"""A finished session's trajectory: its records merged (`prefix_merging`, or one trace per call with `per_request`)
exactly as `polar-mitm merge` would, each sequence split at its prompt into Polar's `Trace`.

`prompt_ids` are the first call's prompt, `response_ids` everything after it: sampled tokens (loss mask 1, their
recorded logprobs) and, between calls, the context the harness added (tool outputs, the next prompt's new part:
mask 0, logprob 0.0). A trace's metadata says which weight versions sampled it, at what temperature, and how the
session ended.
"""

from __future__ import annotations

from pathlib import Path

from polar_mitm.reconstruct.merge import merge_table, recorded_eot
from polar_mitm.service.models import Trace
from polar_mitm.storage.merged import sequences_in
from polar_mitm.storage.records import read_session


def session_traces(
    flows: Path, session_id: str, reward: float | None, builder: str, eot_token_id: int | None
) -> list[Trace]:
    """The traces of `session_id`'s records under `flows` (live journals included), rewarded `reward`."""
    mine = read_session(flows, session_id)
    if mine.num_rows == 0:
        return []
    table, _ = merge_table(mine, builder=builder, eot_token_id=eot_token_id, check=True)
    return [_trace(seq, reward) for seq in sequences_in(table, f"session {session_id}")]


def flows_eot(flows: Path) -> int | None:
    """The end-of-turn id the gateway recorded for its engine (None before its first call)."""
    found = recorded_eot([str(flows)])
    return found[0] if found else None


def _trace(seq, reward: float | None) -> Trace:
    cut = seq.prompt_len
    mask = [int(m) for m in seq.loss_mask[cut:]]
    logprobs = [float(lp) if m else 0.0 for lp, m in zip(seq.logprobs[cut:], mask, strict=True)]
    temperatures = sorted({t for t in (seq.turn_temperature or []) if t is not None})
    return Trace(
        prompt_ids=list(seq.input_ids[:cut]),
        response_ids=list(seq.input_ids[cut:]),
        loss_mask=mask,
        response_logprobs=logprobs,
        finish_reason=seq.finish_reason,
        reward=reward,
        metadata={
            "sequence_id": seq.sequence_id,
            "builder": seq.builder,
            "request_ids": list(seq.request_ids),
            "n_turns": seq.n_turns,
            "weight_version_min": seq.weight_version_min,
            "weight_version_max": seq.weight_version_max,
            "temperature": temperatures[0] if len(temperatures) == 1 else temperatures or None,
        },
    )
