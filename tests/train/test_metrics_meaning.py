"""Metrics that say what they mean (issue 39): the advantage mean is per session (0 in a step of whole groups, however
many sequences a session has) and per loss token; `polar-mitm grpo` prints the data table after the batch plan
(its split_groups as in data_stats.json); the loop's iteration figures carry the training's clip and TIS-cap
fractions — and with num_iterations 1 PPO's clip never acts, so the TIS cap is the whole trust region.

Version distances for every engine's version strings are in tests/train/test_data.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.loop.figures import IterationStats, training_fractions
from polar_mitm.train.data import build_training_data
from polar_mitm.train.grpo_config import PolarGRPOConfig
from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
from tests.train.scored_rows import scored_sequence, task_groups, write_merged

pytestmark = pytest.mark.slow


def steps_of(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def train(model_dir: Path, sequences, out: Path, **fields) -> list[dict]:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_train_epochs=1,
        learning_rate=1e-3,
        report_to=[],
        disable_tqdm=True,
        check_behaviour_logps=False,
        seed=0,
    )
    settings.update(fields)
    trainer = PolarGRPOTrainer(
        str(model_dir), args=PolarGRPOConfig(**settings), train_data=build_training_data(sequences)
    )
    trainer.train()
    return steps_of(out)


def test_the_advantage_mean_counts_each_session_once_and_per_token_weighs_its_tokens(
    tiny_engine, tiny_model_dir, tmp_path
):
    # A group of two: the passing session split into 3 sequences (a broken prefix_merging chain), the failing one 1.
    passed = scored_sequence(tiny_engine, "task", "passed", "Done.", reward=1.0)
    failed = scored_sequence(tiny_engine, "task", "failed", "I will list the files.", reward=0.0)
    sequences = [replace(passed, sequence_id=f"passed:r{k}") for k in range(3)] + [failed]
    (step,) = train(tiny_model_dir, sequences, tmp_path / "run")
    rows = build_training_data(sequences).rows
    by_row = sum(r["advantage"] for r in rows) / len(rows)
    tokens = [sum(r["loss_mask"]) for r in rows]
    by_token = sum(r["advantage"] * n for r, n in zip(rows, tokens, strict=True)) / sum(tokens)
    assert abs(by_row) > 0.3  # what advantages/mean said before: the passing session counted 3 times
    assert step["advantages/mean"] == pytest.approx(0.0, abs=1e-9)
    assert step["advantages/token_mean"] == pytest.approx(by_token, rel=1e-6)
    assert step["advantages/min"] < 0 < step["advantages/max"]


def test_the_printed_data_table_comes_after_the_plan(tiny_engine, tmp_path):
    # A group of 4 sessions and steps of 2 rows: the plan splits the group, which the table must say.
    data = write_merged(task_groups(tiny_engine, 1, group_size=4), tmp_path / "merged")
    out = tmp_path / "run"
    argv = ["grpo", "--data", str(data), "--model", "tiny", "--output-dir", str(out)]
    argv += ["--per-device-batch-size", "2", "--max-steps", "1", "--report-to", "none"]
    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "data_stats.json").read_text())["split_groups"] == 1
    (row,) = [line for line in result.output.splitlines() if "split_groups" in line]
    assert row.split("│")[2].strip() == "1", row


def test_the_iteration_figures_carry_the_clip_and_tis_cap_fractions(tiny_engine, tiny_model_dir, tmp_path):
    # Three steps at a high learning rate: from the second on every row is stale, and many of its tokens' ratios
    # pi_current / pi_behaviour pass the cap of 2.
    out = tmp_path / "run"
    steps = train(tiny_model_dir, task_groups(tiny_engine, 3, group_size=4), out, learning_rate=0.2)
    stale = [s.get("importance_weight/stale_tokens", 0.0) for s in steps]
    capped = [s.get("importance_weight/capped_tokens", 0.0) for s in steps]
    assert stale[0] == 0 and all(n > 0 for n in stale[1:])
    assert sum(capped) > 0
    fractions = training_fractions(out / "metrics.jsonl")
    assert fractions["tis_capped_fraction"] == pytest.approx(sum(capped) / sum(stale))
    assert fractions["clip_fraction"] == 0.0  # num_iterations 1: a stale row's PPO ratio is 1 when it is used
    figures = IterationStats(1, "3", 12, 0.5, 0.5, 0.5, 12, 12, 0, 0, **fractions)
    assert figures.tracked_metrics()["loop/tis_capped_fraction"] == fractions["tis_capped_fraction"]
    assert training_fractions(tmp_path / "none.jsonl") == {"clip_fraction": None, "tis_capped_fraction": None}
