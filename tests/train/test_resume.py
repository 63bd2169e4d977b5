"""`polar-mitm grpo … --resume-from-checkpoint last` continues a stopped run: after a stop past the checkpoint of step 2
(of 4), steps 3 and 4 run once, the final weights equal an uninterrupted run's, the behaviour check stays the one
made at step 0 against the weights that sampled the data, and metrics.jsonl holds every step once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file
from transformers import TrainerCallback
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.train.config_options import GRPO_OPTIONS
from polar_mitm.train.data import load_sequences
from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
from polar_mitm.train.run import grpo_config, training_data
from tests.train.scored_rows import task_groups, write_merged

pytestmark = pytest.mark.slow

STEPS = 4
SAVED_AT = 2  # the last checkpoint before the stop


def grpo_options(data: Path, out: Path) -> list[str]:
    return [
        *("--data", str(data), "-o", str(out), "--model", "tiny", "--report-to", "none"),
        *("--max-steps", str(STEPS), "--save-steps", str(SAVED_AT), "--per-device-batch-size", "2"),
        *("--learning-rate", "1e-2", "--lr-scheduler", "linear", "--warmup-steps", "1", "--seed", "0"),
    ]


def run_grpo(argv: list[str]) -> None:
    result = CliRunner().invoke(app, ["grpo", *argv], catch_exceptions=False)
    assert result.exit_code == 0, result.output


class Stopped(Exception):
    pass


class StopAfterLogging(TrainerCallback):
    """A crash right after step `step` was logged (and before its checkpoint, if it had one)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == self.step:
            raise Stopped(f"stopped after step {self.step}")


def stopped_run(argv: list[str], at_step: int) -> None:
    """What `polar-mitm grpo ARGV` runs (same config and data), stopped after step `at_step` was logged."""
    command = typer.main.get_command(app).commands["grpo"]
    params = command.make_context("grpo", argv).params
    fields = {param.name: params[param.name] for param in command.generated[GRPO_OPTIONS]}
    config = grpo_config(
        fields, output_dir=params["output_dir"], save_steps=params["save_steps"], report_to="none"
    )
    data = training_data(load_sequences(params["data"]), fields)
    trainer = PolarGRPOTrainer(str(resolve_model("tiny")), args=config, train_data=data)
    trainer.add_callback(StopAfterLogging(at_step))
    with pytest.raises(Stopped):
        trainer.train()


def step_records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_engine) -> tuple[Path, Path, str]:
    root = tmp_path_factory.mktemp("resume")
    # Four task groups of two sessions, two rows a step: the four steps are one pass over the data.
    data = write_merged(task_groups(tiny_engine, 4), root / "merged")
    whole, resumed = root / "whole", root / "resumed"
    run_grpo(grpo_options(data, whole))
    stopped_run(grpo_options(data, resumed), at_step=SAVED_AT + 1)
    check_at_step0 = (resumed / "behaviour_check.json").read_text()
    run_grpo([*grpo_options(data, resumed), "--resume-from-checkpoint", "last"])
    return whole, resumed, check_at_step0


def test_the_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(runs, tiny_model_dir):
    whole, resumed, _ = runs
    assert json.loads((resumed / "result.json").read_text())["steps"] == STEPS
    expected, got = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert expected.keys() == got.keys()
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(expected[k], initial[k]) for k in expected)  # it did train
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) <= 1e-6


def test_steps_after_the_checkpoint_run_once_and_metrics_hold_each_step_once(runs):
    whole, resumed, _ = runs
    records = step_records(resumed)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for mine, theirs in zip(records, step_records(whole), strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6), mine["step"]
        assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"], rel=1e-9), mine["step"]
    summaries = [
        r
        for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())
        if "train_runtime" in r
    ]
    assert len(summaries) == 1


def test_the_behaviour_check_stays_the_one_made_against_the_sampling_weights(runs):
    whole, resumed, check_at_step0 = runs
    assert (resumed / "behaviour_check.json").read_text() == check_at_step0  # not re-run at resume
    report = json.loads(check_at_step0)
    assert report["rows_checked"] == 8 and report["rows_over_threshold"] == 0
    for mine, theirs in zip(step_records(resumed), step_records(whole), strict=True):
        assert mine["logp_diff/fresh_mean"] == pytest.approx(theirs["logp_diff/fresh_mean"], abs=1e-9)
        assert mine["logp_diff/frac_over_threshold"] == 0.0, mine["step"]
