"""Staleness per token (merged v4 `span_starts` / `span_versions`): a sequence half sampled by version v and half by
v+1, trained from v+1, is stale on its first half only — anchored and importance-weighted there, untouched on the
rest — and `max_staleness 0` masks exactly that half, counted in the metrics."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from polar_mitm.storage.merged import MergedSequence
from tests.train.test_grpo import make_trainer, recomputed_logps, served_rollouts


def split_versions(seq: MergedSequence, version: int) -> tuple[MergedSequence, int]:
    """`seq` with its first half of sampled tokens under `version` and the rest under `version + 1`, and the index
    (in input_ids) where the second half starts."""
    sampled = np.flatnonzero(np.asarray(seq.loss_mask))
    middle = int(sampled[len(sampled) // 2])
    spans = replace(
        seq,
        span_starts=[seq.prompt_len, middle],
        span_versions=[str(version), str(version + 1)],
        weight_version_min=str(version),
        weight_version_max=str(version + 1),
    )
    return spans, middle


@pytest.fixture(scope="module")
def halves(engine_url, tiny_engine) -> tuple[list[MergedSequence], list[int], int]:
    rollouts = served_rollouts(engine_url, tiny_engine.tokenizer)
    (version,) = {int(r.weight_version_min) for r in rollouts}
    pairs = [split_versions(seq, version) for seq in rollouts]
    return [s for s, _ in pairs], [m for _, m in pairs], version


def first_half_mask(rows: list[dict], middles: list[int], batch: dict) -> torch.Tensor:
    """[B, W] the sampled tokens before each row's middle, in the collated completion layout."""
    split = min(int(r["prompt_len"]) for r in rows)
    width = batch["completion_ids"].size(1)
    positions = torch.arange(width).unsqueeze(0) + split
    sampled = torch.zeros_like(positions, dtype=torch.bool).repeat(len(rows), 1)
    for i, r in enumerate(rows):
        tail = len(r["loss_mask"]) - split
        sampled[i, :tail] = torch.tensor(r["loss_mask"][split:], dtype=torch.bool)
    return sampled & (positions < torch.tensor(middles).unsqueeze(1))


def test_only_the_tokens_of_the_older_version_are_stale(halves, tmp_path):
    from polar_mitm.engine.model_zoo import resolve_model

    sequences, middles, version = halves
    other_weights = resolve_model("tiny", seed=1)  # so current and behaviour logprobs differ
    trainer = make_trainer(
        other_weights,
        sequences,
        tmp_path / "run",
        policy_weight_version=str(version + 1),
        stale_is_clip_max=1.2,
    )
    rows = trainer.train_data.rows
    assert [r["span_versions"] for r in rows] == [[str(version), str(version + 1)]] * len(rows)
    middles = [middles[[s.sequence_id for s in sequences].index(r["sequence_id"])] for r in rows]
    current, batch = recomputed_logps(trainer, rows)
    mask = batch["tool_mask"].bool()
    first = first_half_mask(rows, middles, batch)
    second = mask & ~first
    assert first.any() and second.any() and not (first & ~mask).any()
    staleness = trainer._token_staleness(rows, mask.size(1), mask.device)
    assert set(staleness[first].tolist()) == {1} and set(staleness[second].tolist()) == {0}
    behaviour = batch["sampling_per_token_logps"]
    assert torch.allclose(batch["old_per_token_logps"][first], current[first], atol=1e-5)
    assert torch.equal(batch["old_per_token_logps"][second], behaviour[second])
    base = torch.tensor([r["advantage"] for r in rows]).unsqueeze(1).expand_as(mask)
    weights = batch["advantages"] / torch.where(base == 0, torch.ones_like(base), base)
    nonzero = base != 0
    expected = torch.exp(current - behaviour).clamp(max=1.2)
    assert torch.allclose(weights[first & nonzero], expected[first & nonzero], atol=1e-4)
    assert torch.equal(weights[second & nonzero], torch.ones_like(weights[second & nonzero]))


def test_max_staleness_zero_masks_the_older_half_and_counts_it(halves, tiny_model_dir, tmp_path):
    sequences, middles, version = halves
    trainer = make_trainer(
        tiny_model_dir, sequences, tmp_path / "run", policy_weight_version=str(version + 1), max_staleness=0
    )
    rows = trainer.train_data.rows
    middles = [middles[[s.sequence_id for s in sequences].index(r["sequence_id"])] for r in rows]
    _, batch = recomputed_logps(trainer, rows)
    mask = batch["tool_mask"].bool()
    first = first_half_mask(rows, middles, batch)
    sampled = sum(sum(r["loss_mask"]) for r in rows)
    assert not (mask & first).any() and int(mask.sum()) == sampled - int(first.sum())
    mode = "train" if trainer.model.training else "eval"
    assert trainer._metrics[mode]["staleness/masked_tokens"][-1] == float(first.sum())
    trainer.train()
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["staleness/masked_tokens"] == float(first.sum()) and step["staleness/max"] == 1
