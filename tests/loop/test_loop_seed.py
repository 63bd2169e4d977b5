"""`polar-mitm loop --seed N` (issue 39): the run's seed is an option of the loop, and it is the seed each
iteration's trainer is given (beside the task cycle and the tiny model's initial weights, which read it too)."""

from __future__ import annotations

from pathlib import Path

import typer
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.config_options import CONFIG_FIELDS
from polar_mitm.loop.cli import given_or_resumed_config
from polar_mitm.loop.progress import NoProgress
from polar_mitm.loop.trackers import NoTracker
from polar_mitm.loop.training import IterationTraining


def test_loop_help_lists_seed():
    result = CliRunner().invoke(app, ["loop", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "--seed" in result.output


def test_the_loop_seed_is_each_trainings_seed(tmp_path):
    command = typer.main.get_command(app).commands["loop"]
    ctx = command.make_context("loop", ["tasks.jsonl", "-o", str(tmp_path), "--seed", "7"])
    ctx.meta[CONFIG_FIELDS] = command.generated_values(ctx)  # what the command does as it runs
    cfg = given_or_resumed_config(ctx)
    assert cfg.seed == 7
    training = IterationTraining(
        cfg=cfg,
        iteration=0,
        initial_model_dir=Path("start"),
        model_dir=Path("start"),
        weight_version="0",
        engine_url=None,
        tracker=NoTracker(),
        progress=NoProgress(),
        trainer_callbacks=[],
        recorded_run_dir=tmp_path,
    )
    assert training.fields()["seed"] == 7
