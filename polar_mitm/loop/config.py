"""`LoopConfig`: every setting of `polar-mitm loop`, each with its help (the options are generated from it), and the
names the loop gives the trainer's settings it sets itself. Apart from the loop so that what only needs the config
(informative groups, resume checks, the CLI) imports no loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.reconstruct.builders import BuilderName
from polar_mitm.rollout.runner import RolloutConfig
from polar_mitm.storage.run_layout import RUN_STATE_DIR
from polar_mitm.train.config_options import LORA_HELP

# The settings a loop shares with `polar-mitm rollout` say what they say there.
ROLLOUT_HELP = {f.name: f.metadata for f in dataclasses.fields(RolloutConfig)}


def _help(text: str) -> dict[str, str]:
    return {"help": text}


# PolarGRPOConfig fields the loop sets itself, so `polar-mitm loop` has no option of that name: the loop's own
# option for the same setting (LoopConfig), or what each iteration's training must be told.
LOOP_SETS: dict[str, str] = {
    "learning_rate": "--learning-rate",
    "per_device_train_batch_size": "--batch-size",
    "num_train_epochs": "--epochs",
    "temperature": "--temperature (the gateway samples at it)",
    "seed": "the loop's seed",
    "group_size": "--group-size",
    "push_to_engine": "the loop's engine",
    "policy_weight_version": "the version the engine serves",
    "run_state_dir": f"RUN/{RUN_STATE_DIR}",
    "lr_schedule_trainings": "--iterations",
    "save_merged": "always, with --lora (the merged copy is pushed)",
    "resume_from_checkpoint": "each iteration is a new training",
}
# Where a loop option's default differs from `polar-mitm grpo`'s: the loop's LR stays constant unless asked.
LOOP_TRAINER_DEFAULTS: dict[str, Any] = {"lr_scheduler_type": "constant"}


@dataclass
class LoopConfig:
    """The RL loop's settings; each field with a `help` is a `polar-mitm loop` option (loop/cli.py)."""

    tasks: Path = field(metadata=_help("Task file (JSONL); not needed with --resume."))
    run_dir: Path = field(metadata=_help("Everything of the run goes here."))
    harness: str = field(
        default="sdk:openai_chat", metadata=_help("sdk:PROVIDER | cmd:TEMPLATE | preset name.")
    )
    iterations: int = field(default=2, metadata=_help("RL iterations."))
    group_size: int = field(default=4, metadata=ROLLOUT_HELP["group_size"])
    concurrency: int = field(default=4, metadata=ROLLOUT_HELP["concurrency"])
    gateways: int = field(
        default=1,
        metadata=_help(
            "Gateway processes per rollout (sessions spread across them, records under iter-K/flows/gw-*): "
            "for hundreds of sessions or long prompts, where one gateway's CPU is the bottleneck."
        ),
    )
    model: str = field(default="tiny", metadata=_help("Starting model: tiny | smollm2 | PATH."))
    script: Path | None = field(default=None, metadata=_help("Scripted policy for the embedded engine."))
    engine_url: str | None = field(
        default=None, metadata=_help("Attach to this engine (SGLang) instead of starting one.")
    )
    temperature: float = field(
        default=1.0, metadata=_help("Sampling temperature (forced) = training temperature.")
    )
    max_tokens: int = field(default=256, metadata=_help("Completion budget per model call."))
    learning_rate: float = field(default=5e-3, metadata=_help("Learning rate."))
    per_device_batch_size: int = field(default=4, metadata=_help("Sequences per training micro-batch."))
    epochs: float = field(default=1.0, metadata=_help("Passes over each iteration's sequences."))
    lora: bool = field(
        default=False,
        metadata=_help(
            "Train LoRA adapters on the initial model, carried across iterations (merged copy pushed to the "
            "engine)."
        ),
    )
    lora_r: int = field(default=16, metadata=_help(LORA_HELP["lora_r"]))
    lora_alpha: int = field(default=32, metadata=_help(LORA_HELP["lora_alpha"]))
    lora_target_modules: str = field(default="all-linear", metadata=_help(LORA_HELP["lora_target_modules"]))
    # PolarGRPOConfig fields for every iteration's training, by name (`polar-mitm loop`'s generated trainer options,
    # or set from Python); LOOP_TRAINER_DEFAULTS where absent; the loop's own settings (LOOP_SETS) win.
    grpo: dict[str, Any] = field(default_factory=dict)
    builder: BuilderName = field(
        default=BuilderName.prefix_merging, metadata=_help(BuilderName.__doc__ or "")
    )
    overlap: int = field(
        default=0,
        metadata=_help(
            "N: rollouts run up to N iterations ahead of the trainer (their data up to N weight versions old)."
        ),
    )
    keep: int | None = field(default=None, metadata=ROLLOUT_HELP["keep"])
    seed: int = 0  # the trainer's seed and, for `tiny`, the seed of its initial weights
    ray_address: str | None = field(
        default=None,
        metadata=_help("Rollouts on this Ray cluster (auto | HOST:PORT | local), one gateway per node."),
    )
    # the same `polar-mitm grpo` command recipes/training.md describes, launched N times
    train_processes: int = field(
        default=1,
        metadata=_help(
            "GRPO step as N data-parallel processes (accelerate on GPUs, torchrun + gloo on CPU); same "
            "global batch."
        ),
    )
    final_rollout: bool = (
        False  # after the last training, one more rollout (no training): the trained policy's reward
    )
    eval_tasks: Path | None = field(
        default=None,
        metadata=_help(
            "Held-out task file (JSONL, no task id shared with TASKS): evaluated, never trained on."
        ),
    )
    eval_every: int = field(default=1, metadata=_help("Evaluate after every K-th training (and the last)."))
    eval_samples: int = field(default=4, metadata=_help("Sessions per held-out task (N of pass@k, k <= N)."))
    eval_greedy: bool = field(
        default=False, metadata=_help("Evaluate greedily (temperature 0) instead of at --temperature.")
    )
    eval_start: bool = field(
        default=False,
        metadata=_help(
            "Also evaluate the starting weights on --eval-tasks, before the first rollout (RUN/eval-start): "
            "the held-out baseline."
        ),
    )
    resume: bool = field(
        default=False,
        metadata=_help(
            "Carry on the run in RUN (killed or stopped) with its recorded command: `--resume -o RUN`."
        ),
    )
    yes: bool = field(
        default=False,
        metadata=_help(
            "With --resume: run the harness RUN/run.json records even where it is not this command line's "
            "--harness (the command stops showing both otherwise)."
        ),
    )
    keep_checkpoints: int | None = field(
        default=None,
        metadata=_help("Keep the weights of the last N trainings only (the newest is what --resume needs)."),
    )
    report_to: str = field(
        default="none",
        metadata=_help(
            "tensorboard | mlflow | wandb | none, or a comma list: the loop's figures, evaluations and the "
            "trainer's per-step metrics in one tracked run, continued by --resume; offline only (TensorBoard: "
            "RUN/tensorboard, MLflow file store: RUN/mlruns, W&B offline: RUN/wandb)."
        ),
    )
    min_informative_groups: int | None = field(
        default=None,
        metadata=_help(
            "Dynamic sampling: each iteration starts with N task groups (a seeded cycle through TASKS); groups "
            "whose rewards are all equal are replaced by groups of tasks not yet run in that iteration, until N "
            "are informative or --resample-budget is spent; the flat ones are not trained on (rollout/"
            "informative.py)."
        ),
    )
    resample_budget: int | None = field(
        default=None,
        metadata=_help(
            "With --min-informative-groups N: at most M replacement groups per iteration (default: N)."
        ),
    )
