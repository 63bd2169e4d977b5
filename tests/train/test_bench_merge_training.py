"""benchmarks/bench_merge_training.py at toy size: records through the gateway, merges both ways, trains, prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_merge_training.py"


@pytest.mark.slow
def test_benchmark_trains_both_builders_and_prints_the_table_with_the_ratio(tmp_path):
    args = [
        "--sessions",
        "2",
        "--turns",
        "2",
        "--batch-size",
        "2",
        "--group-size",
        "2",
        "--tool-lines",
        "1",
        "2",
        "--workdir",
        str(tmp_path),
    ]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]

    rows = {
        line.split()[0]: line.split()
        for line in done.stdout.splitlines()
        if line.startswith(("per_request ", "prefix_merging ", "ratio "))
    }
    # 2 sessions × 2 turns: per_request trains 4 sequences in 2 updates, prefix_merging 2 sequences in 1 update.
    assert rows["per_request"][1:3] == ["4", "2"]
    assert rows["prefix_merging"][1:3] == ["2", "1"]
    assert rows["ratio"][2:4] == ["2.00×", "2.00×"]
    assert rows["per_request"][4] == rows["prefix_merging"][4]  # the same sampled tokens, trained either way
    assert "speed-up of prefix_merging over per_request" in done.stdout
    for builder in ("per_request", "prefix_merging"):
        assert (tmp_path / f"run-{builder}" / "metrics.jsonl").stat().st_size > 0
