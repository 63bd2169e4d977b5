"""check_invariants rejects every kind of unfaithful output (each test breaks one property of a good merge)."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pytest

from polar_mitm.reconstruct.invariants import InvariantError, check_invariants
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.reconstruct.turns import sequences_from_table
from polar_mitm.storage.records import RECORD_SCHEMA

IM_START, EOT, NL, USER, ASSISTANT = 151644, 151645, 198, 872, 77091
T0 = datetime(2025, 1, 1, tzinfo=UTC)
P0 = [IM_START, USER, NL, 1000, 1001, EOT, NL, IM_START, ASSISTANT, NL]
S0 = [1002, 1003, EOT]
P1 = P0 + [1004, EOT, NL, IM_START, USER, NL, 1005, EOT, NL, IM_START, ASSISTANT, NL]
S1 = [1006, EOT]


def row(request_id: str, seq: int, prompt, sampled, finish: str = "stop", logprobs=None) -> dict:
    return dict(
        schema_version=1,
        request_id=request_id,
        session_id="s",
        seq=seq,
        started_at=T0,
        finished_at=T0,
        provider="openai_chat",
        path="/v1/chat/completions",
        stream=False,
        prompt_ids=prompt,
        completion_ids=sampled,
        finish_reason=finish,
        completion_logprobs=logprobs
        if logprobs is not None
        else [-0.5 - i for i in range(len(sampled or []))],
    )


@pytest.fixture
def good():
    records = pa.Table.from_pylist(
        [row("a", 0, P0, S0), row("b", 1, P1, S1), row("err", 2, P1, [], "error")], schema=RECORD_SCHEMA
    )
    merged, _ = merge_table(records, eot_token_id=EOT, check=False)
    (seq,) = sequences_from_table(merged)
    seq.input_ids, seq.loss_mask, seq.logprobs = (
        np.array(a) for a in (seq.input_ids, seq.loss_mask, seq.logprobs)
    )
    return records, seq


def test_a_correct_merge_passes(good):
    records, seq = good
    check_invariants(records, [seq])
    assert seq.request_ids == ["a", "b"]


def test_a_changed_logprob_is_caught(good):
    records, seq = good
    seq.logprobs[len(P0) + 1] = np.float32(-0.25)
    with pytest.raises(InvariantError, match="logprob at"):
        check_invariants(records, [seq])


def test_a_logprob_on_a_context_token_is_caught(good):
    records, seq = good
    seq.logprobs[2] = np.float32(-1.0)
    with pytest.raises(InvariantError, match="mask-0 token at 2"):
        check_invariants(records, [seq])


def test_a_context_token_marked_trainable_is_caught(good):
    records, seq = good
    seq.loss_mask[len(P0) + len(S0)] = 1  # the first token after turn a's sampled ids is context
    with pytest.raises(InvariantError):
        check_invariants(records, [seq])


def test_re_encoded_sampled_ids_are_caught(good):
    records, seq = good
    seq.input_ids[len(P0)] = 4242  # e.g. the sampled text re-tokenised instead of the ids really sampled
    with pytest.raises(InvariantError, match="sampled ids not found"):
        check_invariants(records, [seq])


def test_context_that_is_not_a_tail_of_the_prompt_is_caught(good):
    records, seq = good
    seq.input_ids[len(P0) + len(S0)] = 7  # the interstitial no longer matches turn b's prompt
    with pytest.raises(InvariantError, match="not a tail of its prompt"):
        check_invariants(records, [seq])


def test_a_missing_record_is_caught(good):
    records, _ = good
    lonely, _ = merge_table(records.slice(0, 1), eot_token_id=EOT)
    with pytest.raises(InvariantError, match="in no sequence"):
        check_invariants(records, lonely)


def test_a_record_merged_twice_is_caught(good):
    records, seq = good
    with pytest.raises(InvariantError, match="appears twice"):
        check_invariants(records, [seq, seq])


def test_an_error_record_in_a_sequence_is_caught(good):
    records, seq = good
    seq.request_ids = ["a", "err"]
    with pytest.raises(InvariantError, match="excluded"):
        check_invariants(records, [seq])


def test_unequal_lengths_are_caught(good):
    records, seq = good
    seq.logprobs = seq.logprobs[:-1]
    with pytest.raises(InvariantError, match="lengths differ"):
        check_invariants(records, [seq])


def test_a_wrong_prompt_len_is_caught(good):
    records, seq = good
    seq.prompt_len += 1
    with pytest.raises(InvariantError, match="prompt_len"):
        check_invariants(records, [seq])


def test_trailing_tokens_are_caught(good):
    records, seq = good
    seq.input_ids = np.append(seq.input_ids, NL)
    seq.loss_mask = np.append(seq.loss_mask, np.int8(0))
    seq.logprobs = np.append(seq.logprobs, np.float32(0))
    with pytest.raises(InvariantError, match="after the last turn"):
        check_invariants(records, [seq])


def test_turns_out_of_order_are_caught():
    records = pa.Table.from_pylist([row("a", 0, P0, S0), row("b", 1, P0, [1007, EOT])], schema=RECORD_SCHEMA)
    merged, _ = merge_table(records, builder="per_request")
    seqs = sequences_from_table(merged)
    # A hand-made sequence listing b before a (both with prompt P0): turns must follow seq order.
    swapped = seqs[1]
    swapped.request_ids, swapped.n_turns = ["b", "a"], 2
    with pytest.raises(InvariantError, match="session \\(seq\\) order"):
        check_invariants(records, [swapped])


def test_invalid_records_are_excluded_not_trained():
    records = pa.Table.from_pylist(
        [
            row("ok", 0, P0, S0),
            row("no-prompt", 1, None, S0),
            row("misaligned", 2, P0, S0, logprobs=[-1.0]),
            row("empty", 3, P0, []),
            row("aborted", 4, P0, [1002], "abort"),
        ],
        schema=RECORD_SCHEMA,
    )
    merged, summary = merge_table(records, eot_token_id=EOT)
    assert merged["request_ids"].to_pylist() == [["ok"]]
    assert summary.excluded == {
        "abort": 1,
        "empty completion": 1,
        "logprobs missing or misaligned": 1,
        "missing prompt ids": 1,
    }


def test_a_sampled_token_hidden_from_the_loss_is_caught_even_with_logprob_zero():
    # A token sampled with probability 1 has logprob 0.0: only its mask tells it apart from context.
    records = pa.Table.from_pylist([row("a", 0, P0, S0, logprobs=[-0.5, 0.0, -0.25])], schema=RECORD_SCHEMA)
    merged, _ = merge_table(records, eot_token_id=EOT)
    (seq,) = sequences_from_table(merged)
    seq.loss_mask = np.array(seq.loss_mask)
    seq.loss_mask[len(P0) + 1] = 0
    with pytest.raises(InvariantError, match="not all mask 1"):
        check_invariants(records, [seq])
