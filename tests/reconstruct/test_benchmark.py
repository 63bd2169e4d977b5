"""The merge benchmark script still runs and reports its figures (a tiny size; the real run is 100k requests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_merge.py"


@pytest.mark.slow
def test_bench_merge_runs_and_prints_the_comparison():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "150", "--concurrency", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "generated 150 requests" in out
    for label in ("parquet read+write", "merge prefix_merging +check", "Polar routing (reference)"):
        assert label in out
    assert "nothing dropped" in out
