"""The trainer's LM head scores only the tokens the loss reads (train/scoring.py): it projects exactly the sampled
tokens through the vocabulary, their logprobs are those of scoring every position, and the loss and gradients of a
training micro-batch — packed or padded — are unchanged."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import trl.trainer.utils as trl_utils

from tests.train.test_batching_trainer import failing_run_longer, trainer_for

pytestmark = pytest.mark.slow

TOL = 1e-6


@pytest.fixture(scope="module")
def groups(tiny_engine):
    return failing_run_longer(tiny_engine, tasks=2, prefix="s")


@pytest.fixture
def projected(monkeypatch) -> list[int]:
    """Rows the fused head projects through the vocabulary, per call."""
    rows: list[int] = []
    function = trl_utils._ChunkedLogProbFunction

    class Counting(function):
        @staticmethod
        def forward(ctx, hidden, *args):
            rows.append(hidden.size(0))
            return function.forward(ctx, hidden, *args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Counting)
    return rows


def every_position(trainer, monkeypatch) -> None:
    """The head as TRL runs it on CPU: every position of the window, every completion token labelled."""
    monkeypatch.setattr(trl_utils, "_use_triton", trl_utils._use_triton.original)
    monkeypatch.setattr(trainer, "_scoring_only", lambda positions: nullcontext())


def test_only_sampled_tokens_are_projected_and_their_logprobs_are_unchanged(
    groups, tiny_model_dir, tmp_path, projected, monkeypatch
):
    trainer = trainer_for(tiny_model_dir, groups, tmp_path / "run")
    projected.clear()  # the activation-memory probe's forwards at start (train/activation_memory.py)
    batch = trainer._collate(trainer.train_data.rows)
    sampled = batch["loss_mask"].bool()
    logps = trainer.policy_logps(batch)
    assert projected == [int(sampled.sum())]  # the real rows' sampled tokens, nothing else
    assert bool((logps[~sampled] == 0).all())

    every_position(trainer, monkeypatch)
    projected.clear()
    full = trainer.policy_logps(batch)
    width = batch["prompt_ids"].size(1) + batch["completion_ids"].size(1) - 1
    assert projected == [batch["prompt_ids"].size(0) * width]  # TRL on CPU: every position
    assert float((logps - full)[sampled].abs().max()) <= TOL
    assert float((full[~sampled & batch["completion_mask"].bool()]).abs().min()) > 0  # it did score the rest


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_training_micro_batch_has_the_same_loss_and_gradients(
    groups, tiny_model_dir, tmp_path, layout, monkeypatch
):
    def loss_and_gradients(trainer) -> tuple[float, torch.Tensor]:
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = (
            trainer.args.gradient_accumulation_steps
        )  # set by the loop
        scored = trainer._generate_and_score_completions(trainer.train_data.rows[:8])
        micro = trainer._split_micro_batches(scored)[0]
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, micro)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        return float(loss.detach()), grads

    settings = dict(batch_layout=layout, check_behaviour_logps=False, beta=0.04)
    loss, grads = loss_and_gradients(trainer_for(tiny_model_dir, groups, tmp_path / "a", **settings))
    before = trainer_for(tiny_model_dir, groups, tmp_path / "b", **settings)
    every_position(before, monkeypatch)
    full_loss, full_grads = loss_and_gradients(before)
    assert float(grads.abs().max()) > 0
    assert abs(loss - full_loss) <= TOL * max(1.0, abs(full_loss))
    assert float((grads - full_grads).abs().max()) <= TOL * float(full_grads.abs().max())
