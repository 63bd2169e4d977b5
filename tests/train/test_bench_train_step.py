"""benchmarks/bench_train_step.py at toy size: the three paths train the same tokens and print the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_step.py"


@pytest.mark.slow
def test_benchmark_trains_the_same_tokens_three_ways_and_only_today_pads(tmp_path):
    args = ["--sdk-tasks", "1", "--harness-tasks", "1", "--group-size", "2", "--sdk-scale", "0.1"]
    args += [
        "--scale",
        "0.005",
        "--per-device-batch-size",
        "1",
        "--accumulation",
        "2",
        "--workdir",
        str(tmp_path),
    ]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {
        line.split()[0]: line.split()
        for line in done.stdout.splitlines()
        if line.startswith(("today ", "grouped+"))
    }
    assert set(rows) == {"today", "grouped+trimmed", "grouped+packed"}
    useful = {path: int(row[2]) for path, row in rows.items()}
    computed = {path: int(row[3]) for path, row in rows.items()}
    assert len(set(useful.values())) == 1  # the same rows trained on every path
    assert computed["grouped+packed"] == useful["grouped+packed"] < computed["today"]
    assert computed["grouped+trimmed"] < computed["today"]
