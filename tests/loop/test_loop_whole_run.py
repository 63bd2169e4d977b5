"""Issue 39's review kept as a test: a real three-iteration `polar-mitm loop` with dynamic sampling, from a bf16
model, under a linear LR schedule and the run-wide token normaliser, checked from the files it saved — every step's
LR above 0 and never rising, every push bf16, and one loss normaliser for every step of every training.

The sessions are real (the SDK agent through the gateway, the demo's scripted choice policy on the tiny model), so
how many optimizer steps each training takes is what dynamic sampling leaves, as in a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from polar_mitm.storage.run_layout import (
    ENGINE_WEIGHTS_DIR,
    RUN_STATE_DIR,
    SKIPPED_TRAINING_FILE,
    TRAIN_DIR,
    iteration_dir,
)
from polar_mitm.train.continuation import RunState
from tests.train.test_whole_run import bf16_copy

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"
ITERATIONS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> Path:
    root = tmp_path_factory.mktemp("whole-loop")
    model = bf16_copy(tiny_model_dir, root / "bf16-tiny")
    run_dir = root / "run"
    argv = [sys.executable, "-m", "polar_mitm", "loop", str(EXAMPLES / "tasks.jsonl"), "-o", str(run_dir)]
    argv += [
        "-n",
        str(ITERATIONS),
        "-g",
        "4",
        "-c",
        "4",
        "--model",
        str(model),
        "--script",
        str(EXAMPLES / "policy.json"),
    ]
    argv += ["--max-tokens", "64", "--learning-rate", "1e-2", "--lr-scheduler", "linear", "--batch-size", "2"]
    argv += ["--min-informative-groups", "2", "--token-normaliser", "run", "--log-format", "lines"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return run_dir


def trained(run_dir: Path) -> list[Path]:
    folders = [iteration_dir(run_dir, k) / TRAIN_DIR for k in range(ITERATIONS)]
    return [f for f in folders if (f / "metrics.jsonl").exists()]


def steps(folder: Path) -> list[dict]:
    return [
        row for row in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in row
    ]


def test_the_lr_stays_above_zero_and_never_rises_over_the_run(run):
    folders = trained(run)
    assert len(folders) >= 2, "dynamic sampling left fewer than two trainings"
    logged = [(row["run_step"], row["learning_rate"]) for folder in folders for row in steps(folder)]
    assert [step for step, _ in logged] == list(range(1, len(logged) + 1))
    rates = [rate for _, rate in logged]
    assert all(rate > 0 for rate in rates), rates
    assert all(later <= earlier for earlier, later in zip(rates, rates[1:], strict=False)), rates


def test_every_push_from_the_bf16_model_is_bf16(run):
    for folder in trained(run):
        with safe_open(folder / ENGINE_WEIGHTS_DIR / "model.safetensors", framework="pt") as weights:
            assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}, folder


def test_one_loss_normaliser_for_every_step_of_the_run(run):
    state = RunState.load(run / RUN_STATE_DIR)
    # An iteration whose groups all came out flat skips its training (train/skipped.json), and the run counts it
    # among its trainings too (train/continuation.count_skipped_training): every iteration is one or the other.
    skipped = [
        k for k in range(ITERATIONS) if (iteration_dir(run, k) / TRAIN_DIR / SKIPPED_TRAINING_FILE).exists()
    ]
    assert state.loss_tokens_per_step is not None
    assert state.trainings == len(trained(run)) + len(skipped) == ITERATIONS, (state, skipped)
    normalisers = [row["batch/loss_normaliser"] for folder in trained(run) for row in steps(folder)]
    assert normalisers == pytest.approx([state.loss_tokens_per_step] * len(normalisers)), normalisers
