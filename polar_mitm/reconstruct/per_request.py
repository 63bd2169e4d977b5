"""per_request: one training sequence per model call — its prompt (mask 0) then its sampled ids (mask 1).

The baseline builder: always exact, but every call repeats its whole context (the Polar paper's 1185 trainer
updates against prefix_merging's 218).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from polar_mitm.reconstruct.turns import BuildResult, TurnRecord, sampling_columns, version_columns
from polar_mitm.storage.merged import MergedSequence

BUILDER_NAME = "per_request"


def sequence_of_turn(turn: TurnRecord, builder: str = BUILDER_NAME) -> MergedSequence:
    """The one-turn sequence of a trainable record (see `turns.exclusion_reason`)."""
    assert (
        turn.prompt_ids is not None
        and turn.completion_ids is not None
        and turn.completion_logprobs is not None
    )
    n_prompt, n_sampled = len(turn.prompt_ids), len(turn.completion_ids)
    mask = np.zeros(n_prompt + n_sampled, dtype=np.int8)
    mask[n_prompt:] = 1
    logprobs = np.zeros(n_prompt + n_sampled, dtype=np.float32)
    logprobs[n_prompt:] = turn.completion_logprobs
    return MergedSequence(
        sequence_id=f"{turn.session_id}:{turn.request_id}",
        session_id=turn.session_id,
        task_id=turn.task_id,
        input_ids=np.concatenate([turn.prompt_ids, turn.completion_ids]).astype(np.int32, copy=False),
        loss_mask=mask,
        logprobs=logprobs,
        prompt_len=n_prompt,
        request_ids=[turn.request_id],
        n_turns=1,
        builder=builder,
        finish_reason=turn.finish_reason,
        turn_starts=[n_prompt],
        **sampling_columns([turn]),
        **version_columns([turn], [n_prompt]),
    )


def build_per_request(turns: Sequence[TurnRecord], *, eot_token_id: int | None = None) -> BuildResult:
    """One sequence per trainable turn, in the given (session) order. `eot_token_id` is unused."""
    return BuildResult(sequences=[sequence_of_turn(t) for t in turns], breaks=Counter())
