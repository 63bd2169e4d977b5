"""The run directory of `polar-mitm loop` (and the demo): every file and folder name in one place.

    RUN/run.json                  the run's config (what a resume reads back)
    RUN/loop.json                 one row of figures per finished iteration
    RUN/events.jsonl              what happened when (stages begun and ended, skips, resumes)
    RUN/trainer-state/            the optimizer, LR schedule and run state carried across iterations
                  run_state.json  how many trainings, the policy's weight version
    RUN/judge-cache/              the judge's answers by judged content, shared by the run's rollouts
    RUN/eval-start/               --eval-start's evaluation of the starting weights
    RUN/iter-K/state.json         iteration K's stage markers
    RUN/iter-K/sessions.jsonl     its finished sessions, as they finish
    RUN/iter-K/flows/             its records (gw-K/ per gateway, node-*/ per Ray node)
    RUN/iter-K/merged/            its merged sequences
    RUN/iter-K/rewards.parquet    its rewards
    RUN/iter-K/judgments/         with judged tasks: what the judge said (storage/judgments.py)
    RUN/iter-K/service_results.jsonl  with --service: the SessionResults the service answered (no flows/ then)
    RUN/iter-K/train/             its training: checkpoint, metrics.jsonl, skipped.json, engine-weights/

The loop, resume checks, the report and the trainer all take the names from here.
"""

from __future__ import annotations

import re
from pathlib import Path

RUN_RECORD = "run.json"
LOOP_FILE = "loop.json"
EVENTS_FILE = "events.jsonl"
RUN_STATE_DIR = "trainer-state"  # the optimizer carried across iterations
RUN_STATE_FILE = "run_state.json"  # in RUN_STATE_DIR
START_EVAL_DIR = "eval-start"  # --eval-start's evaluation of the starting weights
STATE_FILE = "state.json"  # in iter-K: its stage markers
SESSIONS_FILE = "sessions.jsonl"  # in iter-K: its finished sessions
FLOWS_DIR = "flows"
MERGED_DIR = "merged"
REWARDS_FILE = "rewards.parquet"
SERVICE_RESULTS_FILE = "service_results.jsonl"  # in iter-K, with --service: what the merge reads
TRAIN_DIR = "train"
TRAINING_RESULT_FILE = "result.json"  # in a `polar-mitm grpo` output: what it saved (its presence: finished)
SKIPPED_TRAINING_FILE = "skipped.json"  # in iter-K/train: that training had nothing to learn
ENGINE_WEIGHTS_DIR = (
    "engine-weights"  # in a training's output: the checkpoint the engine was last told to load
)
ITERATION_GLOB = "iter-*"
_ITERATION = re.compile(r"iter-(\d+)")


def iteration_dir(run_dir: Path, k: int) -> Path:
    """`RUN/iter-K`."""
    return run_dir / f"iter-{k}"


def iteration_index(path: Path) -> int | None:
    """K for a folder named `iter-K`, else None."""
    match = _ITERATION.fullmatch(path.name)
    return int(match.group(1)) if match else None
