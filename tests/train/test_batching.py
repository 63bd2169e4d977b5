"""Which rows share an optimizer step (issue 24 items 1-3), as pure functions on training rows: whole groups per step
with a zero mean advantage — where today's length buckets split them —, every row once per epoch over any number of
processes, groups too large for a step split in zero-mean parts, zero-advantage groups left out, micro-batches cut
without padding waste, and the padding of a realistic length mix before and after."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.reconstruct.merge import merge
from polar_mitm.storage.merged import MergedSequence
from polar_mitm.train.batching import (
    BatchShape,
    GroupBatchSampler,
    LengthBucketSampler,
    group_key,
    length_buckets,
    micro_batches,
    plan_batches,
    real_grid,
)
from polar_mitm.train.data import build_training_data

SAMPLES = Path(__file__).resolve().parents[2] / "sample_flows"
TOL = 1e-9


def sequence(task: str | None, session: str, reward: float, length: int, prompt: int = 4) -> MergedSequence:
    ids = list(range(100, 100 + length))
    mask = [0] * prompt + [1] * (length - prompt)
    return MergedSequence(
        sequence_id=f"{session}:{length}",
        session_id=session,
        task_id=task,
        input_ids=ids,
        loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        prompt_len=prompt,
        request_ids=["r"],
        n_turns=1,
        builder="prefix_merging",
        weight_version_min="0",
        weight_version_max="0",
        reward=reward,
    )


def failures_run_longer(groups: int, group_size: int, *, seed: int = 0, flat: int = 0) -> list[dict]:
    """Training rows of `groups` tasks whose failed sessions are 3× as long as their passing ones (the usual case
    for agents), plus `flat` groups where every session passed (zero advantage)."""
    rng = random.Random(seed)
    sequences = []
    for t in range(groups + flat):
        base = rng.randint(20, 200)
        for g in range(group_size):
            passed = t >= groups or g % 2 == 0
            length = base * (1 if passed else 3) + rng.randint(0, 9)
            sequences.append(sequence(f"task-{t}", f"t{t}-s{g}", 1.0 if passed else 0.0, length))
    return build_training_data(sequences).rows


def optimizer_steps(stream: list[int], step_rows: int, real: int, repeat: int = 1) -> list[list[int]]:
    """The rows of each optimizer step in a sampler's stream (steps_per_generation = accumulation steps: one
    generation batch per step), placeholders (indices ≥ `real`) left out."""
    batches = [stream[i : i + step_rows] for i in range(0, len(stream), step_rows)][::repeat]
    return [[i for i in batch if i < real] for batch in batches]


def assert_whole_groups_with_zero_mean(rows: list[dict], steps: list[list[int]], advantage=None) -> None:
    advantage = advantage or {}
    members = Counter(group_key(r) for r in rows)
    for step in steps:
        held = Counter(group_key(rows[i]) for i in step)
        assert all(held[g] == members[g] for g in held), f"a step holds part of a group: {held}"
        mean = sum(advantage.get(i, rows[i]["advantage"]) for i in step) / len(step)
        assert abs(mean) <= TOL, f"a step's mean advantage is {mean}"


def test_every_optimizer_step_holds_whole_groups_and_a_zero_mean_advantage():
    rows = failures_run_longer(groups=12, group_size=4)
    shape = BatchShape(per_device=2, processes=1, steps_per_generation=4, accumulation_steps=4)
    sampler = GroupBatchSampler(plan_batches(rows, shape), shape, placeholder=len(rows), repeat_count=4)
    steps = optimizer_steps(list(sampler), shape.generation_rows, len(rows), repeat=4)
    assert sorted(i for step in steps for i in step) == list(range(len(rows)))
    assert_whole_groups_with_zero_mean(rows, steps)


def test_todays_length_buckets_split_groups_and_give_steps_a_one_signed_advantage():
    # The same data and check on the sampler this replaces: sorting all rows by length puts the short (passing)
    # sessions in early steps and the long (failing) ones in late steps.
    rows = failures_run_longer(groups=12, group_size=4)
    sampler = LengthBucketSampler([len(r["input_ids"]) for r in rows], 8, repeat_count=1, seed=0)
    steps = optimizer_steps(list(sampler), 8, len(rows))
    with pytest.raises(AssertionError):
        assert_whole_groups_with_zero_mean(rows, steps)
    means = [sum(rows[i]["advantage"] for i in s) / len(s) for s in steps]
    assert max(means) > 0.5 and min(means) < -0.5


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_each_process_gets_its_share_of_whole_groups_and_every_row_once(processes):
    rows = failures_run_longer(groups=9, group_size=4, seed=processes)
    shape = BatchShape(per_device=2, processes=processes, steps_per_generation=2, accumulation_steps=2)
    sampler = GroupBatchSampler(plan_batches(rows, shape), shape, placeholder=len(rows), repeat_count=2)
    for _epoch in range(2):
        stream = list(sampler)
        assert len(stream) == len(sampler)
        local = shape.per_device * shape.steps_per_generation  # what each process reads per generation batch
        steps = optimizer_steps(stream, shape.generation_rows, len(rows), repeat=2)
        assert Counter(i for s in steps for i in s) == Counter(range(len(rows)))
        assert_whole_groups_with_zero_mean(rows, steps)
        for start in range(0, len(stream), shape.generation_rows * 2):
            batch = stream[start : start + shape.generation_rows]
            shares = [batch[k * local : (k + 1) * local] for k in range(processes)]
            tokens = [sum(len(rows[i]["input_ids"]) for i in s if i < len(rows)) for s in shares]
            # Longest rows first to the process with the fewest tokens: no process carries twice another's.
            assert max(tokens) <= 2 * min(tokens) + max(len(r["input_ids"]) for r in rows)


def test_set_epoch_shuffles_a_pass_as_the_counted_pass_did():
    # transformers calls set_epoch each epoch: a run resumed in its second pass sees that pass's order.
    rows = failures_run_longer(groups=10, group_size=2)
    shape = BatchShape(per_device=2, processes=1, steps_per_generation=1, accumulation_steps=1)
    plan = plan_batches(rows, shape)
    counted = GroupBatchSampler(plan, shape, placeholder=len(rows), seed=3)
    first, second = list(counted), list(counted)
    resumed = GroupBatchSampler(plan, shape, placeholder=len(rows), seed=3)
    resumed.set_epoch(1)
    assert list(resumed) == second != first and list(resumed) == second
    assert sorted(first) == sorted(second)


def test_a_group_larger_than_a_step_is_split_in_parts_that_each_have_a_zero_mean():
    rows = failures_run_longer(groups=2, group_size=12)
    shape = BatchShape(per_device=2, processes=1, steps_per_generation=4, accumulation_steps=4)
    plan = plan_batches(rows, shape)
    assert plan.split_groups == 2 and plan.uncentred_parts == 0
    steps = [[i for share in chunk for i in share] for chunk in plan.chunks]
    assert all(len(s) <= shape.chunk_rows for s in steps)
    assert sorted(i for s in steps for i in s) == list(range(len(rows)))
    for step in steps:  # parts hold passing and failing sessions, recentred on their own mean
        part = [plan.advantage[i] for i in step]
        assert abs(sum(part) / len(part)) <= TOL and min(part) < 0 < max(part)
    with pytest.raises(AssertionError):  # with the whole group's advantages, the parts' steps would not be 0
        assert_whole_groups_with_zero_mean(rows, steps, advantage={})


def test_zero_advantage_groups_leave_the_plan_unless_kept_and_are_counted():
    rows = failures_run_longer(groups=3, group_size=4, flat=2)
    flat_rows = [i for i, r in enumerate(rows) if r["reward"] == 1.0 and r["task_id"] in ("task-3", "task-4")]
    shape = BatchShape(per_device=4, processes=1, steps_per_generation=2, accumulation_steps=2)
    plan = plan_batches(rows, shape)
    assert set(plan.rows()) == set(range(len(rows))) - set(flat_rows)
    assert (plan.zero_advantage_groups, plan.zero_advantage_rows) == (2, 8)
    assert plan.zero_advantage_tokens == sum(len(rows[i]["input_ids"]) for i in flat_rows)
    kept = plan_batches(rows, shape, keep_zero_advantage=True)
    assert sorted(kept.rows()) == list(range(len(rows))) and kept.zero_advantage_groups == 0
    only_flat = plan_batches([rows[i] for i in flat_rows], shape)  # nothing else left: trained as they are
    assert sorted(only_flat.rows()) == list(range(8)) and only_flat.zero_advantage_kept
    stats = build_training_data(
        [sequence(r["task_id"], r["session_id"], r["reward"], len(r["input_ids"])) for r in rows]
    ).stats
    assert (stats.zero_advantage_groups, stats.zero_advantage_sequences) == (2, 8)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=14),
    per_device=st.integers(1, 4),
    processes=st.integers(1, 3),
    micro=st.sampled_from([(1, 1), (2, 2), (4, 2), (2, 4), (3, 2)]),
    seed=st.integers(0, 5),
)
def test_any_plan_trains_every_informative_row_once_in_steps_of_whole_groups_or_zero_mean_parts(
    sizes, per_device, processes, micro, seed
):
    rng = random.Random(seed)
    sequences = []
    for t, size in enumerate(sizes):
        for g in range(size):
            sequences.append(
                sequence(f"task-{t}", f"t{t}-s{g}", float(rng.random() < 0.5), rng.randint(6, 90))
            )
    rows = build_training_data(sequences).rows
    shape = BatchShape(per_device, processes, *micro)
    plan = plan_batches(rows, shape)
    sampler = GroupBatchSampler(plan, shape, placeholder=len(rows), repeat_count=1, seed=seed)
    stream = list(sampler)
    assert len(stream) == len(sampler) and len(stream) % shape.generation_rows == 0
    informative = {i for i, r in enumerate(rows) if any(rows[j]["advantage"] for j in _group(rows, i))}
    assert Counter(i for i in stream if i < len(rows)) == Counter(informative or range(len(rows)))
    for chunk in plan.chunks:
        assert len(chunk) == processes and all(len(share) <= shape.chunk_slots for share in chunk)
        rows_in = [i for share in chunk for i in share]
        whole = {group_key(rows[i]) for i in rows_in if len(_group(rows, i)) <= shape.chunk_rows}
        assert all(set(_group(rows, i)) <= set(rows_in) for i in rows_in if group_key(rows[i]) in whole)
        # Parts of one session or one reward keep the group's advantages (their step's mean is not 0): all others
        # — whole groups and recentred parts — have a zero mean.
        uncentred = [
            i for i in rows_in if len(_group(rows, i)) > shape.chunk_rows and i not in plan.advantage
        ]
        if rows_in and not uncentred:
            mean = sum(plan.advantage.get(i, rows[i]["advantage"]) for i in rows_in) / len(rows_in)
            assert abs(mean) <= TOL


def _group(rows: list[dict], i: int) -> list[int]:
    return [j for j, r in enumerate(rows) if group_key(r) == group_key(rows[i])]


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 500), max_size=40), count=st.integers(1, 8))
def test_micro_batches_cover_every_row_and_cost_no_more_than_equal_splits(lengths, count):
    for cost in ("grid", "tokens"):
        parts = micro_batches(lengths, count, cost)
        assert len(parts) == count
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        if lengths:
            order = sorted(range(len(lengths)), key=lambda i: lengths[i])
            size = -(-len(order) // count)
            equal = [order[k : k + size] for k in range(0, len(order), size)]
            worst = max(real_grid(p, lengths, cost == "tokens") for p in parts if p)
            assert worst <= max(real_grid(p, lengths, cost == "tokens") for p in equal)


def test_micro_batches_of_a_large_share_are_balanced_within_the_equal_splits_memory():
    # 600 rows × 16 micro-batches: past the dynamic programme's budget, the largest padded micro-batch is minimised.
    rng = random.Random(0)
    lengths = [rng.randint(10, 5000) for _ in range(600)]
    parts = micro_batches(lengths, 16, "grid")
    assert len(parts) == 16 and sorted(i for p in parts for i in p) == list(range(600))
    order = sorted(range(600), key=lambda i: lengths[i])
    equal = [order[k : k + 38] for k in range(0, 600, 38)]
    assert max(real_grid(p, lengths, False) for p in parts) <= max(
        real_grid(p, lengths, False) for p in equal
    )


@pytest.fixture(scope="module")
def recorded_lengths(tmp_path_factory) -> dict[str, list[int]]:
    """Sequence lengths of the repo's recorded sessions, merged: the SDK sessions and the real harness CLIs'."""
    lengths = {}
    for kind, folder in (("sdk", SAMPLES / "records"), ("harness", SAMPLES / "harness")):
        out = tmp_path_factory.mktemp(kind)
        merge([str(folder)], str(out))
        lengths[kind] = [len(ids) for ids in pq.read_table(out)["input_ids"].to_pylist()]
    return lengths


def test_padding_of_a_realistic_length_mix_before_and_after(recorded_lengths):
    # Groups of 4 sessions: short SDK tasks and long harness tasks (the recorded lengths, failures up to 3× longer),
    # trained 2 rows per micro-batch and 4 micro-batches per step (a generation batch of 8 rows).
    rng = random.Random(0)
    sequences = []
    for t in range(16):
        kind = "harness" if t % 4 == 0 else "sdk"
        base = rng.choice(recorded_lengths[kind])
        for g in range(4):
            length = int(base * (1.0 if g % 2 == 0 else rng.uniform(1.5, 3.0)))
            sequences.append(sequence(f"{kind}-{t}", f"t{t}-s{g}", float(g % 2 == 0), length, prompt=200))
    rows = build_training_data(sequences).rows
    lengths = [len(r["input_ids"]) for r in rows]
    shape = BatchShape(per_device=2, processes=1, steps_per_generation=4, accumulation_steps=4)

    # Today: length buckets of 8 rows, every micro-batch as wide as its generation batch's longest row, the
    # placeholders that fill the last bucket computed like rows.
    buckets = length_buckets(lengths, shape.generation_rows, seed=0)
    today = 1 - sum(lengths) / sum(
        len(b) * max(lengths[i % len(lengths)] for i in b if i < len(lengths)) for b in buckets
    )
    plan = plan_batches(rows, shape)
    shares = [share for chunk in plan.chunks for share in chunk]
    grid = sum(
        real_grid(part, [lengths[i] for i in share], False)
        for share in shares
        for part in micro_batches([lengths[i] for i in share], shape.micro_per_chunk, "grid")
        if part
    )
    trimmed = 1 - sum(lengths) / grid
    print(
        f"\npadding fraction, {len(rows)} rows of {sum(lengths)} tokens: today {today:.1%}, grouped + trimmed {trimmed:.1%}"
    )
    # Packed micro-batches (the default wherever the loss allows it) hold no padding at all.
    assert today > 0.3 and trimmed < today / 5 and trimmed <= 0.10
