"""GRPO on CPU measurably raises the reward of a toy task on the tiny model (sample → train → reload → sample)."""

from __future__ import annotations

import pytest

from polar_mitm.train.toy import run_toy_grpo

pytestmark = pytest.mark.slow


def test_grpo_raises_the_toy_reward_over_a_few_iterations(tiny_model_dir, tmp_path):
    run = run_toy_grpo(
        tiny_model_dir,
        tmp_path,
        iterations=3,
        steps_per_iteration=2,
        learning_rate=1e-2,
        temperature=0.05,
        n_prompts=4,
        group_size=8,
        max_new_tokens=8,
        seed=1,
    )
    start, end = run.rewards[0], run.rewards[-1]
    # Seeds fixed; seen: 0.52 → 0.98–1.0 (chance is about one half). A sign error or no update stays near 0.5.
    assert end >= start + 0.25, run.rewards
    assert end >= 0.8, run.rewards
    # Each round loaded the trained weights into the engine under a new version: the data's version + 2 steps.
    assert run.weight_versions == ["0", "2", "4", "6"]
