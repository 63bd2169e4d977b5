"""The capstone's warm start (issue 46), `benchmarks/warm_start.py` at its smallest: the teacher solves generated file
tasks through the real Pi CLI on the tiny engine (every session passes its check), the records are merged and
exported by `polar-mitm sft`, and TRL's SFTTrainer trains a checkpoint from them that differs from the start —
while no held-out task is ever in the teacher's script; then both the start and the checkpoint sample the held-out
tasks freely through Pi and are scored."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from polar_mitm.engine.model_zoo import resolve_model

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "warm_start.py"


def test_the_teacher_passes_every_task_through_pi_and_sft_trains_a_new_checkpoint(tmp_path):
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed: Pi needs it")
    run_dir = tmp_path / "warm"
    argv = [
        sys.executable,
        str(BENCH),
        "--run-dir",
        str(run_dir),
        "--model",
        "tiny",
        "--families",
        "write,fix",
    ]
    argv += ["--train-tasks", "1", "--held-out-tasks", "1", "--epochs", "1", "--learning-rate", "1e-3"]
    argv += ["--eval-samples", "1", "--max-tokens", "16", "--eval-engine", "embedded"]  # vLLM: the capstone's
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "warm_start.json").read_text())
    assert summary["sessions"] == summary["passed"] == 2, summary  # the teacher solved both, through Pi
    assert summary["sft_accepted"]["accepted"] == 2 and summary["trained_tokens"] > 0, summary
    assert summary["steps"] >= 1 and summary["loss_first"] > 0, summary
    for stage in (
        "start",
        "warm_start",
    ):  # the held-out tasks, sampled freely by the start and the checkpoint
        figures = summary["held_out"][stage]
        assert figures["attempts"] == figures["sessions"] == figures["tasks"] == 2, figures
        assert 0.0 <= figures["tool_call_rate"] <= 1.0 and figures["parse_failures"] >= 0, figures
        assert figures["ci95"][0] <= figures["pass@1"] <= figures["ci95"][1], figures
    assert summary["held_out"]["warm_start"]["model"] == str(run_dir / "model")
    teacher = (run_dir / "teacher.json").read_text()
    for line in (run_dir / "tasks" / "held_out.jsonl").read_text().splitlines():
        assert json.loads(line)["prompt"] not in teacher
    trained = load_file(str(run_dir / "model" / "model.safetensors"))
    start = load_file(str(resolve_model("tiny") / "model.safetensors"))
    changed = max(float((trained[k].float() - start[k].float()).abs().max()) for k in start if k in trained)
    assert changed > 0, "the warm start trained nothing"
