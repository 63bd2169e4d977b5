"""Data-parallel GRPO on CPU: two processes (torchrun, gloo) train like one process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from polar_mitm.engine.generation import Engine
from polar_mitm.storage.merged import MERGED_SCHEMA
from polar_mitm.train.toy import make_toy_task, sample_rollouts

pytestmark = pytest.mark.slow


def grpo(launcher: list[str], data: Path, out: Path, model: Path, per_device: int) -> list[dict]:
    args = [
        "-m",
        "polar_mitm.cli",
        "grpo",
        "--data",
        str(data),
        "--model",
        str(model),
        "-o",
        str(out),
        "--max-steps",
        "2",
        "--learning-rate",
        "3e-3",
        "--per-device-batch-size",
        str(per_device),
        "--gradient-accumulation-steps",
        "2",
        "--temperature",
        "0.05",
        "--report-to",
        "none",
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([*launcher, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_two_processes_match_one_process_with_the_same_global_batch(tiny_model_dir, tmp_path):
    engine = Engine(tiny_model_dir)
    rollouts = sample_rollouts(engine, make_toy_task(engine, temperature=0.05), seed=3)
    (tmp_path / "merged").mkdir()
    pq.write_table(
        pa.Table.from_pylist([s.to_row() for s in rollouts], schema=MERGED_SCHEMA),
        tmp_path / "merged" / "part-0.parquet",
    )
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", "2"]
    two = grpo(torchrun, tmp_path / "merged", tmp_path / "two", tiny_model_dir, per_device=4)
    one = grpo([sys.executable], tmp_path / "merged", tmp_path / "one", tiny_model_dir, per_device=8)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm", "reward", "advantages/std", "num_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
    one_w, two_w = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("one", "two"))
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, weight in one_w.items():
        moved = float((weight - start[name]).abs().max())
        # Adam moved each tensor by ~lr per step; the two runs differ by float summation order only (gloo
        # all-reduce vs one process), amplified on near-zero gradients to ~1e-5.
        assert moved > 1e-3 and float((weight - two_w[name]).abs().max()) < 0.02 * moved, name
