"""The KL penalty (issue 39): each estimator's gradient has the direction its help states (exactly, over a small
vocabulary); the penalty divides by the policy term's normaliser whatever the micro-batches hold; stale rows take
their truncated importance weight; and `kl`, `kl/k1..k3` are one per-token mean over the optimizer step's loss tokens.

Rows are scored by the tiny model (tests/train/scored_rows.py); the reference differs from the policy either by hand
(an offset on each loss token's reference logprob) or as a perturbed copy of the tiny model."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from polar_mitm.train.data import build_training_data
from polar_mitm.train.grpo_config import PolarGRPOConfig
from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
from polar_mitm.train.kl import KL_ESTIMATORS, kl_estimates
from tests.train.scored_rows import task_groups
from tests.train.test_batching_trainer import failing_run_longer

pytestmark = pytest.mark.slow

BETA = 0.1


def test_each_estimators_expected_gradient_is_the_kl_its_help_names():
    torch.manual_seed(0)
    logits = torch.randn(7, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(7, dtype=torch.float64), -1)
    policy = torch.log_softmax(logits, -1)
    probs = (
        policy.exp().detach()
    )  # the tokens are sampled from π: the expectation weighs each by π, no gradient

    def gradient(value: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(value, logits, retain_graph=True)[0]

    expected = {name: gradient((probs * k).sum()) for name, k in kl_estimates(policy - ref).items()}
    reverse = gradient((policy.exp() * (policy - ref)).sum())  # ∇ KL(π ‖ π_ref)
    forward = gradient((ref.exp() * (ref - policy)).sum())  # ∇ KL(π_ref ‖ π)
    assert torch.allclose(expected["k1"], torch.zeros(7, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(expected["k2"], reverse, atol=1e-12)
    assert torch.allclose(expected["k3"], forward, atol=1e-12)
    assert not torch.allclose(reverse, forward, atol=1e-3)
    values = {name: float((probs * k).sum()) for name, k in kl_estimates(policy - ref).items()}
    true_kl = float((probs * (policy - ref)).sum())
    assert values["k1"] == pytest.approx(true_kl) and values["k3"] == pytest.approx(
        true_kl
    )  # unbiased values


def make_trainer(model_dir: Path, sequences, out: Path, **overrides) -> PolarGRPOTrainer:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=3,
        gradient_accumulation_steps=4,
        max_steps=1,
        learning_rate=1e-2,
        beta=BETA,
        report_to=[],
        disable_tqdm=True,
        check_behaviour_logps=False,
        seed=0,
    )
    settings.update(overrides)
    return PolarGRPOTrainer(
        str(model_dir), args=PolarGRPOConfig(**settings), train_data=build_training_data(sequences)
    )


def step_kl_penalty(trainer: PolarGRPOTrainer) -> tuple[float, dict, torch.Tensor]:
    """The KL term of one optimizer step as the training loop computes it: the loss of each micro-batch with the
    reference moved by a random offset in [-1, 1] on each loss token, less the same loss with the reference at the
    policy. Returns it, the scored batch and the offsets."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    scored = trainer._generate_and_score_completions(trainer.train_data.rows)
    policy = trainer.policy_logps(scored)
    mask = (scored["completion_mask"] * scored["tool_mask"]).bool()
    generator = torch.Generator().manual_seed(1)
    offset = torch.rand(policy.shape, generator=generator, dtype=torch.float32) * 2 - 1
    losses = []
    for reference in (policy, policy - offset * mask):
        micro = trainer._split_micro_batches({**scored, "ref_per_token_logps": reference})
        with torch.no_grad():
            losses.append(sum(float(trainer.compute_loss(trainer.model, m)) for m in micro))
    return losses[1] - losses[0], scored, offset


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_kl_term_divides_by_the_policy_terms_normaliser(tiny_engine, tiny_model_dir, tmp_path, loss_type):
    # 3 groups of 4 (failures 3x longer), 3 rows × 4 micro-batches per step: micro-batches of 1 to 3 rows, where
    # TRL's KL was divided by each micro-batch's own rows or tokens.
    sequences = failing_run_longer(tiny_engine, tasks=3)
    trainer = make_trainer(tiny_model_dir, sequences, tmp_path / loss_type, loss_type=loss_type)
    penalty, scored, offset = step_kl_penalty(trainer)
    mask = (scored["completion_mask"] * scored["tool_mask"]).float()
    per_row = (0.5 * offset**2 * mask).sum(-1)  # k2 of d = offset, per row
    tokens, rows = mask.sum(-1), mask.size(0)
    if loss_type == "grpo":
        expected = (per_row / tokens).sum() / rows  # each row's token mean, averaged over the step's rows
    elif loss_type == "dr_grpo":
        expected = per_row.sum() / (trainer.step_row_capacity() * trainer.dr_grpo_constant)
    else:  # bnpo, dapo: the step's loss tokens
        expected = per_row.sum() / tokens.sum()
    assert rows == 12 and trainer.args.kl_estimator == "k2"
    assert penalty == pytest.approx(BETA * float(expected), rel=1e-4)


def test_stale_rows_weigh_their_kl_by_the_truncated_importance_ratio(tiny_engine, tiny_model_dir, tmp_path):
    penalties = {}
    for name, shift, version in (("fresh", 0.0, "0"), ("stale", -0.5, "1"), ("capped", -1.0, "1")):
        # Behaviour logprobs `shift` below the model's: once stale, each token's ratio is exp(-shift).
        sequences = task_groups(tiny_engine, 1, group_size=4, logprob_shift=shift)
        trainer = make_trainer(
            tiny_model_dir,
            sequences,
            tmp_path / name,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=1,
            policy_weight_version=version,
        )
        penalties[name], _, _ = step_kl_penalty(trainer)
    assert penalties["fresh"] > 0
    assert penalties["stale"] == pytest.approx(math.exp(0.5) * penalties["fresh"], rel=1e-4)
    assert penalties["capped"] == pytest.approx(2.0 * penalties["fresh"], rel=1e-4)  # stale_is_clip_max


def perturbed_copy(model_dir: Path, out: Path) -> Path:
    shutil.copytree(model_dir, out)
    generator = torch.Generator().manual_seed(0)
    weights = load_file(model_dir / "model.safetensors")
    noisy = {n: w + 0.02 * torch.randn(w.shape, generator=generator) for n, w in weights.items()}
    save_file(noisy, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_the_kl_metrics_are_per_token_means_over_the_steps_loss_tokens(tiny_engine, tiny_model_dir, tmp_path):
    reference = perturbed_copy(tiny_model_dir, tmp_path / "reference")
    sequences = failing_run_longer(tiny_engine, tasks=2)
    out = tmp_path / "run"
    trainer = make_trainer(
        tiny_model_dir,
        sequences,
        out,
        learning_rate=0.0,  # the policy stays the starting model, so its logprobs can be recomputed after
        reference_model=str(reference),
        kl_estimator="k3",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    trainer.train()
    (step,) = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    scored = trainer._generate_and_score_completions(trainer.train_data.rows)
    mask = (scored["completion_mask"] * scored["tool_mask"]).bool()
    d = (trainer.policy_logps(scored) - scored["ref_per_token_logps"])[mask]
    means = {name: float(k.mean()) for name, k in kl_estimates(d).items()}
    assert means["k1"] > 1e-3  # the reference differs
    for name in KL_ESTIMATORS:
        assert step[f"kl/{name}"] == pytest.approx(means[name], rel=1e-4), name
    assert step["kl"] == step["kl/k3"]  # the penalised estimator
