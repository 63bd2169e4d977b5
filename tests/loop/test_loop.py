"""The RL loop end to end on CPU: rollout through the gateway → merge with rewards → GRPO → weights pushed."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.loop import Loop
from polar_mitm.storage.records import read_all

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [0, 1], ids=["sequential", "overlap"])
def test_loop_iterations_train_push_and_record_new_weight_versions(tmp_path, overlap):
    cfg = LoopConfig(
        tasks=EXAMPLES / "tasks.jsonl",
        run_dir=tmp_path / "run",
        iterations=2,
        group_size=2,
        concurrency=2,
        model="tiny",
        script=EXAMPLES / "policy.json",
        learning_rate=1e-2,
        max_tokens=128,
        overlap=overlap,
        grpo={"keep_zero_advantage_groups": True},  # every iteration trains, flat or not (versions grow)
    )
    results = Loop(cfg).run()
    assert [r.iteration for r in results] == [0, 1]
    for r in results:
        assert r.sessions == 6 and r.requests >= 6 and r.sequences >= 3 and r.trainable_tokens > 0
    # Each iteration's training pushed new weights to the engine: versions grow.
    assert int(results[1].weight_version) > int(results[0].weight_version) > 0
    versions = [
        {row["weight_version"] for row in read_all(tmp_path / "run" / f"iter-{k}" / "flows").to_pylist()}
        for k in (0, 1)
    ]
    assert versions[0] == {"0"}
    # Sequential: iteration 1 samples from iteration 0's pushed weights. With overlap it starts while iteration 0
    # trains: its calls sample version 0 until the push and the new one after it (all of them when the training
    # is done before the first call — the tiny model trains in seconds; test_loop_overlap gates a straddle).
    if overlap:
        assert versions[1] <= {"0", results[0].weight_version}
    else:
        assert versions[1] == {results[0].weight_version}
    rewards = pq.read_table(tmp_path / "run" / "iter-1" / "rewards.parquet").to_pylist()
    assert len(rewards) == 6 and all(r["reward"] in (0.0, 1.0) for r in rewards)
    assert (tmp_path / "run" / "iter-1" / "train" / "model.safetensors").exists()
    assert len(json.loads((tmp_path / "run" / "loop.json").read_text())) == 2


@pytest.mark.slow
def test_loop_trains_with_two_data_parallel_processes(tmp_path):
    """`--train-processes 2`: the GRPO step runs as `polar-mitm grpo` in two torchrun processes (gloo on CPU)."""
    cfg = LoopConfig(
        tasks=EXAMPLES / "tasks.jsonl",
        run_dir=tmp_path / "run",
        iterations=1,
        group_size=2,
        concurrency=2,
        model="tiny",
        script=EXAMPLES / "policy.json",
        learning_rate=1e-2,
        max_tokens=128,
        train_processes=2,
        grpo={"keep_zero_advantage_groups": True},  # it trains even when both groups are flat
    )
    results = Loop(cfg).run()
    train = tmp_path / "run" / "iter-0" / "train"
    result = json.loads((train / "result.json").read_text())
    assert result["steps"] > 0 and results[0].weight_version == result["weight_version"] != "0"
    assert (train / "model.safetensors").exists() and (
        tmp_path / "run" / "iter-0" / "data_stats.json"
    ).exists()
    assert result["processes"] == 2
