"""Training data: merged shards → groups, advantages, exact truncation, batches (pure functions, no model)."""

from __future__ import annotations

import math
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_mitm.storage.merged import MERGED_SCHEMA, MergedDataError, MergedSequence
from polar_mitm.train.advantages import group_advantages
from polar_mitm.train.batching import (
    LengthBucketSampler,
    collate,
    length_buckets,
    padding_fraction,
    padding_sources,
)
from polar_mitm.train.data import build_training_data, load_sequences, truncate
from polar_mitm.train.stats import advanced_version, newest_weight_version, version_distance


def seq(
    session: str,
    task: str | None,
    reward: float | None,
    *,
    prompt: int = 3,
    sampled: int = 2,
    tail_context: int = 0,
    sampled_again: int = 0,
    version: str = "0",
    sid: str | None = None,
) -> MergedSequence:
    """prompt (mask 0) + sampled + optional context (a tool result, mask 0) + sampled again."""
    ids = list(range(100, 100 + prompt + sampled + tail_context + sampled_again))
    mask = [0] * prompt + [1] * sampled + [0] * tail_context + [1] * sampled_again
    logprobs = [-0.5 - 0.01 * i if m else 0.0 for i, m in enumerate(mask)]
    return MergedSequence(
        sequence_id=sid or f"{session}-{len(ids)}",
        session_id=session,
        task_id=task,
        input_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        prompt_len=prompt,
        request_ids=["r"],
        n_turns=1 + bool(sampled_again),
        builder="prefix_merging",
        weight_version_min=version,
        weight_version_max=version,
        reward=reward,
    )


def test_mean_std_advantages_match_trl_formula():
    rewards = [1.0, 0.0, 0.5, 0.5]
    sequences = [seq(f"s{i}", "t", r) for i, r in enumerate(rewards)]
    adv = group_advantages(sequences)
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)  # Bessel, as TRL's nanstd
    for i, r in enumerate(rewards):
        assert adv.advantage[f"s{i}"] == pytest.approx((r - mean) / (std + 1e-4))
    unscaled = group_advantages(sequences, scale_rewards="none")
    assert unscaled.advantage["s0"] == pytest.approx(0.5)


def test_leave_one_out_uses_the_other_sessions_mean():
    sequences = [seq(f"s{i}", "t", r) for i, r in enumerate([1.0, 0.0, 0.0])]
    adv = group_advantages(sequences, estimator="leave_one_out")
    assert adv.advantage == pytest.approx({"s0": 1.0, "s1": -0.5, "s2": -0.5})


def test_zero_variance_and_singleton_groups_get_exactly_zero():
    sequences = [seq(f"z{i}", "same", 0.1) for i in range(3)]  # 0.1 * 3 / 3 != 0.1 in floats
    sequences += [seq("alone", "solo", 1.0), seq("nogroup", None, 1.0)]
    sequences += [seq("a", "t", 1.0), seq("b", "t", 0.0)]
    adv = group_advantages(sequences)
    assert all(adv.advantage[f"z{i}"] == 0.0 for i in range(3))
    assert adv.advantage["alone"] == 0.0 and adv.advantage["nogroup"] == 0.0
    assert adv.advantage["a"] > 0 > adv.advantage["b"]
    assert adv.zero_variance_groups == 1 and adv.singleton_groups == 2


def test_every_sequence_of_a_session_shares_its_advantage_and_unrewarded_sessions_are_left_out():
    sequences = [
        seq("a", "t", 1.0, sid="a1"),
        seq("a", "t", 1.0, sid="a2", prompt=5),
        seq("b", "t", 0.0, sid="b1"),
        seq("c", "t", None, sid="c1"),
    ]
    data = build_training_data(sequences)
    by_id = {r["sequence_id"]: r for r in data.rows}
    assert set(by_id) == {"a1", "a2", "b1"}
    assert by_id["a1"]["advantage"] == by_id["a2"]["advantage"] > 0 > by_id["b1"]["advantage"]
    assert data.stats.unrewarded_sessions == 1 and data.stats.sessions == 3


def test_group_size_check_counts_mismatched_groups():
    sequences = [seq(f"s{i}", "t4", float(i % 2)) for i in range(4)] + [
        seq(f"u{i}", "t3", float(i)) for i in range(3)
    ]
    data = build_training_data(sequences, group_size=4)
    assert data.stats.group_sizes == {3: 1, 4: 1}
    assert data.stats.group_size_mismatches == 1


def test_truncation_keeps_an_exact_causal_prefix_with_each_token_and_its_logprob():
    original = seq("a", "t", 1.0, prompt=4, sampled=3, tail_context=2, sampled_again=3)
    cut = truncate(original, 8)
    assert cut is not None
    assert cut.input_ids == original.input_ids[:8]
    assert cut.loss_mask == original.loss_mask[:8]
    assert cut.logprobs == original.logprobs[:8]  # position i keeps logprob i: never shifted or split
    assert truncate(original, 100) is original
    assert truncate(original, 4) is None  # nothing sampled within the first 4 tokens


def test_max_length_drops_sequences_without_sampled_tokens_and_reports_truncation():
    sequences = [seq("a", "t", 1.0, prompt=3, sampled=4), seq("b", "t", 0.0, prompt=6, sampled=2)]
    data = build_training_data(sequences, max_length=5)
    assert [r["session_id"] for r in data.rows] == ["a"]
    assert len(data.rows[0]["input_ids"]) == 5
    assert data.stats.truncated == 1 and data.stats.dropped_no_sampled_tokens == 1


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda s: s.logprobs.pop(), "lengths differ"),
        (lambda s: s.logprobs.__setitem__(4, float("nan")), "not a finite"),
        (lambda s: s.logprobs.__setitem__(4, float("-inf")), "not a finite"),
        (lambda s: s.loss_mask.__setitem__(0, 1), "inside the prompt"),
    ],
)
def test_reading_rejects_rows_that_break_the_merged_invariants(tmp_path, corrupt, message):
    bad = seq("a", "t", 1.0)
    corrupt(bad)
    pq.write_table(pa.Table.from_pylist([bad.to_row()], schema=MERGED_SCHEMA), tmp_path / "bad.parquet")
    with pytest.raises(MergedDataError, match=message):
        load_sequences(tmp_path)


def test_load_sequences_round_trips_a_directory_of_shards(tmp_path):
    sequences = [seq(f"s{i}", "t", float(i)) for i in range(5)]
    (tmp_path / "sub").mkdir()
    pq.write_table(
        pa.Table.from_pylist([s.to_row() for s in sequences[:2]], schema=MERGED_SCHEMA),
        tmp_path / "a.parquet",
    )
    pq.write_table(
        pa.Table.from_pylist([s.to_row() for s in sequences[2:]], schema=MERGED_SCHEMA),
        tmp_path / "sub" / "b.parquet",
    )
    back = load_sequences(tmp_path)
    assert sorted(s.session_id for s in back) == [f"s{i}" for i in range(5)]
    assert back[0].input_ids == sequences[0].input_ids
    assert back[0].logprobs == pytest.approx(sequences[0].logprobs)


def test_collate_splits_every_row_at_the_shortest_prompt_and_pads_only_on_the_right():
    rows = build_training_data(
        [
            seq("a", "t", 1.0, prompt=3, sampled=2, tail_context=2, sampled_again=1),
            seq("b", "t", 0.0, prompt=5, sampled=1),
        ]
    ).rows
    batch = collate(rows, pad_token_id=0)
    assert batch["prompt_ids"].shape == (2, 3) and bool(batch["prompt_mask"].all())
    a, b = rows
    assert batch["completion_ids"][0].tolist() == a["input_ids"][3:]
    assert batch["completion_ids"][1].tolist() == b["input_ids"][3:] + [0, 0]
    assert batch["completion_mask"][1].tolist() == [1, 1, 1, 0, 0]
    # b's prompt tokens past the split are context: in the completion, never in the loss.
    assert batch["loss_mask"][1].tolist() == [0, 0, 1, 0, 0]
    assert batch["loss_mask"][0].tolist() == a["loss_mask"][3:]
    logps = batch["behaviour_logps"]
    assert logps[0].tolist() == pytest.approx(a["logprobs"][3:])
    assert float(logps[batch["loss_mask"] == 0].abs().max()) == 0.0  # exactly 0.0 off the sampled tokens
    assert batch["advantages"].tolist() == pytest.approx([a["advantage"], b["advantage"]])


def test_length_buckets_waste_less_padding_than_random_batches_and_cover_every_row():
    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(10, 50), rng.randint(500, 3000)]) for _ in range(200)]
    buckets = length_buckets(lengths, 8, seed=1)
    assert sorted(i for b in buckets for i in b) == list(range(200))
    shuffled = list(range(200))
    rng.shuffle(shuffled)
    random_batches = [shuffled[i : i + 8] for i in range(0, 200, 8)]
    assert padding_fraction(lengths, buckets) < 0.1 < 0.4 < padding_fraction(lengths, random_batches)


def test_sampler_repeats_each_generation_batch_for_trls_buffering():
    sampler = LengthBucketSampler([5, 1, 9, 3, 7], batch_size=2, repeat_count=3, shuffle=False)
    order = list(sampler)
    assert len(order) == len(sampler) == 3 * 2 * 3
    assert order[:6] == [1, 3] * 3 and order[6:12] == [0, 4] * 3
    # The last batch is filled up to full size with a zero-weight placeholder (dataset index 5): a copy of the
    # next-shorter row 4, not a second use of a row.
    assert order[12:14] == [2, 5] and padding_sources([5, 1, 9, 3, 7], 2) == [4]


def test_version_distance():
    assert version_distance("5", "3") == 2
    assert version_distance("5", "5") == 0
    assert version_distance("3", "5") == 0  # newer than the policy: never negative
    assert version_distance("b", "a") == 1 and version_distance(None, "7") == 0


@pytest.mark.parametrize(
    ("current", "recorded", "distance"),
    [
        ("default+7", "default", 7),  # SGLang's / vLLM's own label, advanced by the trainer's steps
        ("default+7", "default+3", 4),
        ("default+3+2", "default+1", 4),  # (what the trainer wrote before it carried the count on)
        ("step-120", "step-117", 3),  # a number embedded at the end
        ("v12", "v3", 9),
        ("default", "default+2", 0),
        ("run-a+2", "run-b", 1),  # two labels: no distance to read
    ],
)
def test_staleness_is_the_version_distance_for_every_engines_version_strings(current, recorded, distance):
    assert version_distance(current, recorded) == distance


def test_the_policy_version_counts_on_in_the_engines_own_form():
    assert [advanced_version(v, 3) for v in ("12", "default", "default+4", "step-9", None)] == [
        "15",
        "default+3",
        "default+7",
        "step-9+3",
        "3",
    ]
    assert advanced_version("default+4", 0) == "default+4"
    rows = [{"weight_version_max": v} for v in ("default+3", "default+12", "default")]
    assert newest_weight_version(rows) == "default+12"  # by count, not by name ("default+3" > "default+12")


def test_count_ones_does_not_overflow_on_int8_masks():
    """Masks read from Arrow are int8 arrays: a plain `sum` wraps past 127 sampled tokens (200 → -56)."""
    import numpy as np

    from polar_mitm.train.data import count_ones

    mask = np.ones(200, dtype=np.int8)
    assert count_ones(mask) == 200 and count_ones([0, 1, 1, 0]) == 2
