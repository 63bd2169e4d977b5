"""The trainer over a whole run (issue 39): three trainings carried on by one optimizer (`run_state_dir`), each from
the one before's weights, taking 1, then 4, then 2 optimizer steps (as dynamic sampling leaves them), with a linear
LR schedule planned over 3 trainings. The LR stays above 0 on every step taken and decays monotonically to the
schedule's end after the last one; and starting from a bf16 model, every training's engine checkpoint is bf16, not
only the first one's; and with token_normaliser=run every step of the run divides by the first training's loss
tokens per step, kept in the run state.

The trainings are what the loop's in-process training runs (loop/training.py), on rows scored by the tiny model."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import get_scheduler

from polar_mitm.storage.run_layout import ENGINE_WEIGHTS_DIR
from polar_mitm.train.continuation import RunState, SchedulePlan, follow_plan, replanned
from polar_mitm.train.data import build_training_data
from polar_mitm.train.grpo_config import PolarGRPOConfig
from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
from polar_mitm.train.sync import SOURCE_DTYPE_KEY, set_checkpoint_dtype
from tests.train.scored_rows import task_groups

pytestmark = pytest.mark.slow

LEARNING_RATE = 1e-2
STEPS = (1, 4, 2)  # optimizer steps of the three trainings: one task group of two rows a step


def bf16_copy(model_dir: Path, out: Path) -> Path:
    """The tiny model with its weights rounded to bf16 and declared so (as a bf16 checkpoint from the Hub is)."""
    shutil.copytree(model_dir, out)
    weights = load_file(model_dir / "model.safetensors")
    save_file(
        {name: w.to(torch.bfloat16) for name, w in weights.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    set_checkpoint_dtype(out, torch.bfloat16)
    return out


def train(start: Path, out: Path, rows, run_state: Path, **fields) -> PolarGRPOTrainer:
    """One training as the loop runs it: trained, its engine checkpoint written, then its weights and run state."""
    config = PolarGRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=2,
        num_train_epochs=1,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="linear",
        run_state_dir=str(run_state),
        report_to=[],
        disable_tqdm=True,
        check_behaviour_logps=False,
        **fields,
    )
    trainer = PolarGRPOTrainer(str(start), args=config, train_data=rows)
    trainer.train()
    trainer.save_for_engine(out / ENGINE_WEIGHTS_DIR)
    trainer.save_final()
    return trainer


def logged_lrs(out: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [(r["run_step"], r["learning_rate"]) for r in rows if "loss" in r]


def strictly_decreasing(values: list[float]) -> bool:
    return all(later < earlier for earlier, later in zip(values, values[1:], strict=False))


def dtypes_of(directory: Path) -> set[torch.dtype]:
    with safe_open(directory / "model.safetensors", framework="pt") as weights:
        return {weights.get_tensor(name).dtype for name in weights.keys()}


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, tiny_engine) -> Path:
    root = tmp_path_factory.mktemp("whole-run")
    start = bf16_copy(tiny_model_dir, root / "bf16-start")
    for k, steps in enumerate(STEPS):
        rows = build_training_data(task_groups(tiny_engine, steps, prefix=f"it{k}-"))
        out = root / f"iter-{k}"
        trainer = train(
            start, out, rows, root / "trainer-state", lr_schedule_trainings=len(STEPS), token_normaliser="run"
        )
        assert trainer.state.global_step == steps
        start = out  # full weights: the next training continues from this one's
    return root


def test_the_lr_decays_over_every_step_of_trainings_of_different_lengths(run):
    logged = [entry for k in range(len(STEPS)) for entry in logged_lrs(run / f"iter-{k}")]
    assert [step for step, _ in logged] == list(range(1, sum(STEPS) + 1))
    lrs = [lr for _, lr in logged]
    assert all(lr > 0 for lr in lrs), lrs
    assert strictly_decreasing(lrs), lrs
    # Horizon 3 (the first training's 1 step × 3); the second spreads positions 1..3 over 4 steps × 2 trainings,
    # the third 2..3 over its 2 steps.
    positions = [0, 1, 1.25, 1.5, 1.75, 2, 2.5]
    assert lrs == pytest.approx([LEARNING_RATE * (3 - p) / 3 for p in positions], rel=1e-9)
    state = RunState.load(run / "trainer-state")
    assert (state.trainings, state.optimizer_steps, state.schedule_steps) == (3, sum(STEPS), 3)
    scheduler = torch.load(run / "trainer-state" / "scheduler.pt", weights_only=True)
    assert set(scheduler["_last_lr"]) == {0.0}  # (each parameter group) the schedule ends after the last step


def test_every_training_from_a_bf16_model_writes_a_bf16_engine_checkpoint(run):
    for k in range(len(STEPS)):
        out = run / f"iter-{k}"
        pushed = out / ENGINE_WEIGHTS_DIR
        assert dtypes_of(pushed) == {torch.bfloat16}, k
        assert json.loads((pushed / "config.json").read_text())["dtype"] == "bfloat16", k
        # The trainer's own copy, which the next training starts from, keeps fp32 and records the initial dtype.
        assert dtypes_of(out) == {torch.float32}, k
        assert json.loads((out / "config.json").read_text())[SOURCE_DTYPE_KEY] == "bfloat16", k


def test_every_step_of_the_run_divides_by_the_first_trainings_loss_tokens_per_step(run):
    logged = [
        r
        for k in range(len(STEPS))
        for r in map(json.loads, (run / f"iter-{k}" / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    first_step = logged[0]["batch/loss_tokens"]  # the first training took one step
    assert RunState.load(run / "trainer-state").loss_tokens_per_step == first_step
    assert [r["batch/loss_normaliser"] for r in logged] == [first_step] * sum(STEPS)
    assert len({r["batch/loss_tokens"] for r in logged}) > 1  # what `step` would have divided by


def test_steps_past_lr_schedule_steps_warn_and_keep_the_last_lr(
    tmp_path, tiny_model_dir, tiny_engine, caplog
):
    rows = build_training_data(task_groups(tiny_engine, 4))
    with caplog.at_level(logging.WARNING, logger="polar_mitm.train.continuation"):
        train(tiny_model_dir, tmp_path / "out", rows, tmp_path / "state", lr_schedule_steps=2)
    assert [lr for _, lr in logged_lrs(tmp_path / "out")] == pytest.approx(
        [LEARNING_RATE, LEARNING_RATE / 2, 0, 0]
    )
    assert any("2 of this training's 4 steps" in r.getMessage() for r in caplog.records), caplog.text


def scheduled_lrs(kind: str, trainings: list[int], warmup: int = 0) -> tuple[list[float], float]:
    """The LR of every step of `trainings` (their step counts) as the trainer schedules them — a fresh transformers
    scheduler per training over the first one's horizon, the saved state (plan included) loaded, then re-planned —
    and the LR the schedule has reached after the last step."""
    horizon, saved, done, lrs = trainings[0] * len(trainings), None, 0, []
    for k, steps in enumerate(trainings):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LEARNING_RATE)
        scheduler = get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=horizon)
        follow_plan(scheduler, horizon)
        if saved is not None:
            optimizer.load_state_dict(saved[0])
            scheduler.load_state_dict(saved[1])
        replanned(SchedulePlan.of(scheduler), done, steps, len(trainings) - k, horizon, fixed=False).attach(
            scheduler
        )
        for _ in range(steps):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        done += steps
        saved = (optimizer.state_dict(), scheduler.state_dict())
    return lrs, scheduler.get_last_lr()[0]


def test_a_constant_lr_stays_and_a_cosine_one_decays_after_its_warmup_whatever_the_trainings_lengths():
    assert scheduled_lrs("constant", [1, 8, 2, 8]) == ([LEARNING_RATE] * 19, LEARNING_RATE)
    lrs, after = scheduled_lrs("cosine", [2, 8, 1, 8], warmup=1)
    assert lrs[0] == 0.0 and all(lr > 0 for lr in lrs[1:]) and after == pytest.approx(0.0, abs=1e-12), lrs
    assert strictly_decreasing(lrs[1:]), lrs
