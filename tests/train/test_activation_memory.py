"""Activation checkpointing where memory says so (issue 39): the activation bytes per token measured by a probe
forward scale with the tokens and shrink under checkpointing; the estimate for the largest planned micro-batch is
close to what its real forward keeps; and the trainer turns checkpointing on, saying so, when the estimate exceeds
`memory_budget_gb`, and leaves it off within it or with `inf`."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from polar_mitm.train.activation_memory import (
    GB,
    MicroBatchTooLarge,
    activation_bytes_per_token,
    checkpointed_bytes_per_token,
    saved_activation_bytes,
)
from polar_mitm.train.batching import micro_batches
from polar_mitm.train.data import build_training_data
from polar_mitm.train.grpo_config import PolarGRPOConfig
from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
from tests.train.test_batching_trainer import failing_run_longer

pytestmark = pytest.mark.slow


def make_trainer(model_dir: Path, sequences, out: Path, **overrides) -> PolarGRPOTrainer:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=1,
        learning_rate=1e-3,
        report_to=[],
        disable_tqdm=True,
        check_behaviour_logps=False,
        seed=0,
    )
    settings.update(overrides)
    return PolarGRPOTrainer(
        str(model_dir), args=PolarGRPOConfig(**settings), train_data=build_training_data(sequences)
    )


@pytest.fixture(scope="module")
def sequences(tiny_engine):
    return failing_run_longer(tiny_engine, tasks=3)


def test_activation_bytes_per_token_scale_with_tokens_and_shrink_under_checkpointing(
    sequences, tiny_model_dir, tmp_path
):
    trainer = make_trainer(tiny_model_dir, sequences, tmp_path / "run", memory_budget_gb=math.inf)
    model, device = trainer.model, trainer.accelerator.device
    per_token, per_scored = activation_bytes_per_token(model, device)
    ids = torch.randint(0, 1000, (1, 257), generator=torch.Generator().manual_seed(0))
    one = torch.zeros(1, 256, dtype=torch.bool)
    one[0, -1] = True
    measured = saved_activation_bytes(model, ids, one)
    assert measured == pytest.approx(257 * per_token, rel=0.05)  # linear in the tokens
    assert per_token > 1000 and per_scored >= 0  # fp32, hidden 32, 2 layers: ~5.6 kB a token
    checkpointed = checkpointed_bytes_per_token(model, device)
    assert checkpointed < 0.2 * per_token
    assert (
        not model.is_activation_checkpointing and not model.training
    )  # the probe leaves the model as it was


def test_the_estimate_is_close_to_what_the_largest_micro_batch_keeps(sequences, tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, sequences, tmp_path / "run", memory_budget_gb=100.0)
    estimate = trainer.activation_estimate
    rows = trainer.train_data.rows
    # The largest planned micro-batch, packed (the CPU default) into one row: its real forward's saved bytes.
    largest = max(
        (
            [share[k] for k in part]
            for chunk in trainer.batch_plan().chunks
            for share in chunk
            for part in micro_batches(
                [len(rows[i]["input_ids"]) for i in share], trainer._batch_shape().micro_per_chunk, "tokens"
            )
            if part
        ),
        key=lambda members: sum(len(rows[i]["input_ids"]) for i in members),
    )
    ids = torch.tensor([sum((rows[i]["input_ids"] for i in largest), [])])
    scored = torch.tensor([sum((rows[i]["loss_mask"] for i in largest), [])[1:]], dtype=torch.bool)
    assert ids.size(1) == estimate["tokens"] and int(scored.sum()) == estimate["scored"]
    measured = saved_activation_bytes(trainer.model, ids, scored)
    assert estimate["bytes"] == pytest.approx(measured, rel=0.1)


@pytest.fixture(scope="module")
def budgets(sequences, tiny_model_dir, tmp_path_factory) -> dict[str, float]:
    """Budgets (GB) on either side of what the largest micro-batch needs checkpointed and not."""
    trainer = make_trainer(
        tiny_model_dir, sequences, tmp_path_factory.mktemp("budgets"), memory_budget_gb=100.0
    )
    estimate = {**trainer.activation_estimate, "budget": math.inf}
    trainer._refuse_what_checkpointing_cannot_fit(
        estimate
    )  # within an infinite budget: measured, not refused
    plain, checkpointed = estimate["bytes"], estimate["checkpointed_bytes"]
    assert checkpointed < plain
    return {
        "fits checkpointed": (checkpointed + plain) / 2 / GB,
        "fits": 100.0,
        "never": math.inf,
        "too small": checkpointed / 2 / GB,
    }


@pytest.mark.parametrize(
    ("budget", "chosen"), [("fits checkpointed", True), ("fits", False), ("never", False)]
)
def test_checkpointing_is_turned_on_when_the_activations_exceed_the_budget(
    sequences, tiny_model_dir, tmp_path, caplog, budgets, budget, chosen
):
    with caplog.at_level(logging.INFO, logger="polar_mitm.train.activation_memory"):
        trainer = make_trainer(tiny_model_dir, sequences, tmp_path / "run", memory_budget_gb=budgets[budget])
    assert bool(trainer.args.activation_checkpointing) is chosen
    said = [r.getMessage() for r in caplog.records if r.name == "polar_mitm.train.activation_memory"]
    if budget == "never":
        assert said == [] and trainer.activation_estimate is None  # no probe
    else:
        assert len(said) == 1 and said[0].startswith(f"activation checkpointing {'on' if chosen else 'off'}")
    trainer.train()
    assert trainer.model.is_activation_checkpointing is chosen


def test_a_micro_batch_that_cannot_fit_even_checkpointed_is_refused_naming_the_options(
    sequences, tiny_model_dir, tmp_path, budgets
):
    """Before, checkpointing was turned on and the training went on to be killed by the kernel (20.7 GB, stop 56)."""
    with pytest.raises(MicroBatchTooLarge, match="even with activation checkpointing") as refused:
        make_trainer(tiny_model_dir, sequences, tmp_path / "run", memory_budget_gb=budgets["too small"])
    said = str(refused.value)
    assert "--per-device-batch-size" in said and "--gradient-accumulation-steps" in said and "now 4" in said


def test_polar_mitm_grpo_says_it_in_one_line_and_exits_2(
    sequences, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    from polar_mitm.cli import main
    from polar_mitm.user_errors import DEBUG_ENV
    from tests.train.test_grpo import write_shard

    monkeypatch.setenv(DEBUG_ENV, "")
    data = write_shard(sequences, tmp_path / "merged")
    argv = ["grpo", "--data", str(data), "--model", str(tiny_model_dir), "-o", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--per-device-batch-size", "4", "--memory-budget-gb", "1e-9", "--report-to", "none"])
    err = capsys.readouterr().err
    said = [
        line for line in err.splitlines() if line.startswith("polar-mitm:")
    ]  # beside transformers' load bar
    assert exited.value.code == 2 and len(said) == 1 and "Traceback" not in err, err
    assert "even with activation checkpointing" in said[0] and "--per-device-batch-size" in said[0]
