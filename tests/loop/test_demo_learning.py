"""The demo learns (issue 12): one GRPO iteration on the CPU demo tasks raises the trained model's probability of
choosing the candidate that passes each task's check. With the learning rate at 0 the weights do not move, the
probabilities stay exactly where they started, and this test fails.

The full figures (three seeds, last-iteration reward ≥ 0.85 from ≈ 0.5) are measured by
benchmarks/bench_demo_learning.py; this shorter run checks the mechanism: the scripted choice is the model's own
probability of each whole answer, so training that raises the right answer's token logprobs raises its choice.
"""

from __future__ import annotations

import json

import pytest

from polar_mitm.demo import right_choice_probabilities
from polar_mitm.engine.model_zoo import resolve_model

pytestmark = pytest.mark.slow


def test_one_training_iteration_raises_the_right_choice_probability(demo_run):
    run_dir, results = demo_run
    flows = run_dir / "iter-0" / "flows"
    before = right_choice_probabilities(resolve_model("tiny", seed=0), flows)
    after = right_choice_probabilities(run_dir / "iter-0" / "train", flows)
    assert set(before) == {"hello-file", "fix-typo", "append-done"}
    # A random model starts near an even choice between two equally long candidates.
    assert all(0.3 < p < 0.7 for p in before.values()), before
    mean_before, mean_after = sum(before.values()) / 3, sum(after.values()) / 3
    assert mean_after >= mean_before + 0.05, (before, after)  # typically +0.2; exactly 0 at learning rate 0


def test_demo_loop_rolls_out_the_trained_policy_last(demo_run):
    run_dir, results = demo_run
    assert [r.iteration for r in results] == [0, 1]
    trained, final = results
    assert trained.seconds["train"] > 0 and final.seconds["train"] == 0.0
    assert final.sessions == trained.sessions == 12
    assert final.weight_version == trained.weight_version != "0"  # sampled from the pushed weights
    assert len(json.loads((run_dir / "loop.json").read_text())) == 2
