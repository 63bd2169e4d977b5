"""The RL loop: rollout → merge → GRPO → push → repeat, its configuration, run state, resume checks,
informative groups, evaluation, trackers and progress."""
