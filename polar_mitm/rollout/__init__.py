"""Rollouts at scale: task files, staged worker pools (INIT → READY → RUN → POST-RUN → teardown), the RL loop."""
