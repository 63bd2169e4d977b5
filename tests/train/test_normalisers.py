"""The loss normalisers over a whole run (issue 39): dr_grpo divides by the step's row capacity × L, L the completion
budget fixed by the run's first training (its longest row's loss tokens) and recorded in the run state, so later
trainings on longer rows keep it; token_normaliser=run divides dapo by the first training's loss tokens per step in
every step of every training, where the default (`step`) divides by each step's own — which differ between steps,
since steps hold length-sorted groups.

Trainings as the loop runs them (one run state carried on), on rows scored by the tiny model whose failures are 3×
longer than their passes (tests/train/test_batching_trainer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_mitm.train.continuation import RunState
from polar_mitm.train.data import build_training_data
from polar_mitm.train.grpo_config import PolarGRPOConfig
from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
from polar_mitm.train.normalisers import longest_loss_tokens
from tests.train.test_batching_trainer import failing_run_longer

pytestmark = pytest.mark.slow

ROWS_PER_STEP = 4  # one group of 4 sessions a step


def train(
    model_dir: Path, sequences, out: Path, run_state: Path, **fields
) -> tuple[PolarGRPOTrainer, list[dict]]:
    config = PolarGRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=ROWS_PER_STEP,
        num_train_epochs=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        run_state_dir=str(run_state),
        report_to=[],
        disable_tqdm=True,
        check_behaviour_logps=False,
        seed=0,
        **fields,
    )
    trainer = PolarGRPOTrainer(str(model_dir), args=config, train_data=build_training_data(sequences))
    trainer.train()
    trainer.save_run_state()
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    return trainer, steps


def test_dr_grpo_divides_every_training_by_the_first_trainings_completion_budget(
    tiny_engine, tiny_model_dir, tmp_path
):
    budgets = []
    for k, tasks in enumerate((1, 2, 3)):  # each training's rows longer than the one before's
        sequences = failing_run_longer(tiny_engine, tasks=tasks, prefix=f"dr{k}-")
        trainer, steps = train(
            tiny_model_dir, sequences, tmp_path / f"it{k}", tmp_path / "state", loss_type="dr_grpo"
        )
        budgets.append(longest_loss_tokens(trainer.train_data.rows))
        first = budgets[0]
        assert trainer.dr_grpo_constant == trainer.max_completion_length == first, k
        assert [s["batch/loss_normaliser"] for s in steps] == [ROWS_PER_STEP * first] * tasks, k
        assert RunState.load(tmp_path / "state").dr_grpo_constant == first
    assert budgets[0] < budgets[1] < budgets[2]  # the data's own budget grew; the run's stayed


@pytest.mark.parametrize("normaliser", ["step", "run"])
def test_dapo_divides_by_each_steps_loss_tokens_or_by_the_runs_constant(
    tiny_engine, tiny_model_dir, tmp_path, normaliser
):
    logged = []
    for k in range(2):
        sequences = failing_run_longer(tiny_engine, tasks=3 + k, prefix=f"{normaliser}{k}-")
        trainer, steps = train(
            tiny_model_dir, sequences, tmp_path / f"it{k}", tmp_path / "state", token_normaliser=normaliser
        )
        logged += steps
        if k == 0:
            planned = trainer.batch_plan().rows()
            first = sum(sum(trainer.train_data.rows[i]["loss_mask"]) for i in planned) / len(steps)
    tokens = [s["batch/loss_tokens"] for s in logged]
    normalisers = [s["batch/loss_normaliser"] for s in logged]
    assert len(set(tokens)) > 2  # steps of different lengths
    if normaliser == "step":
        assert normalisers == tokens
        assert RunState.load(tmp_path / "state").loss_tokens_per_step is None
    else:
        assert normalisers == pytest.approx([first] * len(logged))
        assert RunState.load(tmp_path / "state").loss_tokens_per_step == pytest.approx(first)
    # The first step's ratios are 1, so its loss is -(sum of A over its loss tokens) / its normaliser.
    step = logged[0]
    token_sum = step["advantages/token_mean"] * step["batch/loss_tokens"]
    assert step["loss"] == pytest.approx(-token_sum / step["batch/loss_normaliser"], rel=1e-3, abs=1e-6)
    assert abs(step["advantages/mean"]) < 1e-6 and abs(step["advantages/token_mean"]) > 0.1
