"""`LoopConfig`: every setting of `polar-mitm loop`, each with its help and command-line spelling (the options are
generated from it: loop/cli.py, polar_mitm/config_options.py), and the names the loop gives the trainer's settings it
sets itself. The settings a loop shares with `polar-mitm rollout` are rollout's fields' own (`field_metadata`). Apart
from the loop so that what only needs the config (informative groups, resume checks, the CLI) imports no loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.config_options import field_metadata, option, python_only
from polar_mitm.judges.options import JudgeFailure, JudgeOptions
from polar_mitm.log_format import LogFormat
from polar_mitm.reconstruct.builders import BuilderName
from polar_mitm.rollout.cli import RolloutCommandOptions
from polar_mitm.rollout.runner import RolloutConfig
from polar_mitm.storage.run_layout import RUN_STATE_DIR
from polar_mitm.storage.session_ends import RULED_ENDS, EndRule, EndRules
from polar_mitm.train.config_options import LORA_HELP
from polar_mitm.train.learning_rate import LEARNING_RATE_HELP

# PolarGRPOConfig fields the loop sets itself, so `polar-mitm loop` has no option of that name: the loop's own
# option for the same setting (LoopConfig), or what each iteration's training must be told.
LOOP_SETS: dict[str, str] = {
    "learning_rate": "--learning-rate",
    "per_device_train_batch_size": "--batch-size",
    "num_train_epochs": "--epochs",
    "temperature": "--temperature (the gateway samples at it)",
    "seed": "--seed",
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
    """The RL loop's settings; each field is a `polar-mitm loop` option of its help (loop/cli.py) but the few set from
    Python only (`python_only`)."""

    tasks: Path = field(
        metadata=option("Task file (JSONL); not needed with --resume.", argument=True, default=None)
    )
    run_dir: Path = field(
        metadata=option(
            "Everything of the run goes here.", "--run-dir", "--out", "-o", default=Path("runs/loop")
        )
    )
    iterations: int = field(default=2, metadata=option("RL iterations.", "--iterations", "-n"))
    harness: str = field(
        default=RolloutCommandOptions.harness, metadata=field_metadata(RolloutCommandOptions, "harness")
    )
    group_size: int = field(
        default=RolloutConfig.group_size, metadata=field_metadata(RolloutConfig, "group_size")
    )
    concurrency: int = field(
        default=RolloutConfig.concurrency, metadata=field_metadata(RolloutConfig, "concurrency")
    )
    gateways: int = field(
        default=1,
        metadata=option(
            "Gateway processes per rollout (sessions spread across them, records under iter-K/flows/gw-*): "
            "for hundreds of sessions or long prompts, where one gateway's CPU is the bottleneck."
        ),
    )
    model: str = field(default="tiny", metadata=option("Starting model: tiny | smollm2 | PATH."))
    script: Path | None = field(default=None, metadata=option("Scripted policy for the embedded engine."))
    engine_url: str | None = field(
        default=None, metadata=option("Attach to this engine (SGLang) instead of starting one.", "--engine")
    )
    temperature: float = field(
        default=1.0, metadata=option("Sampling temperature (forced) = training temperature.")
    )
    max_tokens: int = field(default=256, metadata=option("Completion budget per model call."))
    learning_rate: float | None = field(
        default=None, metadata=option(LEARNING_RATE_HELP)
    )  # None: by model kind, fixed when the run starts (Loop.run) and recorded
    per_device_batch_size: int = field(
        default=4, metadata=option("Sequences per training micro-batch.", "--batch-size")
    )
    epochs: float = field(default=1.0, metadata=option("Passes over each iteration's sequences."))
    lora: bool = field(
        default=False,
        metadata=option(
            "Train LoRA adapters on the initial model, carried across iterations (merged copy pushed to the "
            "engine)."
        ),
    )
    lora_r: int = field(default=16, metadata=option(LORA_HELP["lora_r"]))
    lora_alpha: int = field(default=32, metadata=option(LORA_HELP["lora_alpha"]))
    lora_target_modules: str = field(default="all-linear", metadata=option(LORA_HELP["lora_target_modules"]))
    grpo: dict[str, Any] = field(
        default_factory=dict,
        metadata=python_only(
            "PolarGRPOConfig fields for every iteration's training, by name (`polar-mitm loop`'s generated "
            "trainer options, or set from Python); LOOP_TRAINER_DEFAULTS where absent; the loop's own settings "
            "(LOOP_SETS) win."
        ),
    )
    builder: BuilderName = field(
        default=BuilderName.prefix_merging, metadata=option(BuilderName.__doc__ or "")
    )
    overlap: int = field(
        default=0,
        metadata=option(
            "N: rollouts run up to N iterations ahead of the trainer (their data up to N weight versions old)."
        ),
    )
    keep: int | None = field(default=RolloutConfig.keep, metadata=field_metadata(RolloutConfig, "keep"))
    # What training does with a rewarded session by how it ended (storage/session_ends.py): keep = as recorded,
    # zero = the failure reward, mask = left out (its group uses the others). Applied where the merge joins rewards.
    on_length: EndRule = field(
        default=EndRule.keep,
        metadata=option(
            "A session whose last answer hit --max-tokens. keep: the check's reward already "
            "says whether the cut answer did the job, and masking would hide the overlong habit from training "
            "(mask is DAPO's overlong filtering)."
        ),
    )
    on_unparsed_tool_call: EndRule = field(
        default=EndRule.zero,
        metadata=option(
            "A session whose last answer held a tool call the parser could not read. zero: "
            "breaking the tool protocol is a failure whatever the workspace shows, and the group learns it."
        ),
    )
    on_context_overflow: EndRule = field(
        default=EndRule.mask,
        metadata=option(
            "A session whose last call's prompt overflowed the engine's context. mask: the "
            "run's context limit, not the policy's last answer, stopped it mid-work."
        ),
    )
    on_harness_timeout: EndRule = field(
        default=EndRule.zero,
        metadata=option(
            "A session killed by its run timeout. zero: a policy that does not finish in "
            "time fails (the runner's failure reward, as before)."
        ),
    )
    on_harness_crash: EndRule = field(
        default=EndRule.zero,
        metadata=option(
            "A session whose harness exited non-zero (never graded), or whose setup failed. "
            "zero: the failure reward it had before; mask where a harness crashes for reasons of its own."
        ),
    )
    on_engine_error: EndRule = field(
        default=EndRule.mask,
        metadata=option(
            "A session whose last call the engine answered with an error. mask: the engine "
            "failed, not the policy; nothing to learn from it."
        ),
    )
    sandbox: str = field(default=RolloutConfig.sandbox, metadata=field_metadata(RolloutConfig, "sandbox"))
    image: str | None = field(default=RolloutConfig.image, metadata=field_metadata(RolloutConfig, "image"))
    seed: int = field(
        default=0,
        metadata=option(
            "Seed of the trainer (data order, initialisation), of --min-informative-groups' task cycle and, "
            "for --model tiny, of its initial weights."
        ),
    )
    service_url: str | None = field(
        default=None,
        metadata=option(
            "Every rollout and evaluation on this running `polar-mitm serve-rollouts` (its engine is the one "
            "trained: weights pushed through it); $POLAR_SERVICE_TOKEN is sent when set.",
            "--service",
        ),
    )
    ray_address: str | None = field(
        default=None,
        metadata=option(
            "Rollouts on this Ray cluster (auto | HOST:PORT | local), one gateway per node.", "--ray"
        ),
    )
    # the same `polar-mitm grpo` command recipes/training.md describes, launched N times
    train_processes: int = field(
        default=1,
        metadata=option(
            "GRPO step as N data-parallel processes (accelerate on GPUs, torchrun + gloo on CPU); same "
            "global batch."
        ),
    )
    final_rollout: bool = field(
        default=False,
        metadata=python_only(
            "After the last training, one more rollout (no training): the trained policy's reward."
        ),
    )
    eval_tasks: Path | None = field(
        default=None,
        metadata=option(
            "Held-out task file (JSONL, no task id shared with TASKS): evaluated, never trained on."
        ),
    )
    eval_every: int = field(default=1, metadata=option("Evaluate after every K-th training (and the last)."))
    eval_samples: int = field(default=4, metadata=option("Sessions per held-out task (N of pass@k, k <= N)."))
    eval_greedy: bool = field(
        default=False, metadata=option("Evaluate greedily (temperature 0) instead of at --temperature.")
    )
    eval_start: bool = field(
        default=False,
        metadata=option(
            "Also evaluate the starting weights on --eval-tasks, before the first rollout (RUN/eval-start): "
            "the held-out baseline."
        ),
    )
    report_to: str = field(
        default="none",
        metadata=option(
            "tensorboard | mlflow | wandb | none, or a comma list: the loop's figures, evaluations and the "
            "trainer's per-step metrics in one tracked run, continued by --resume; offline only (TensorBoard: "
            "RUN/tensorboard, MLflow file store: RUN/mlruns, W&B offline: RUN/wandb)."
        ),
    )
    log_format: LogFormat = field(
        default=LogFormat.auto, metadata=field_metadata(RolloutCommandOptions, "log_format")
    )
    min_informative_groups: int | None = field(
        default=None,
        metadata=option(
            "Dynamic sampling: each iteration starts with N task groups (a seeded cycle through TASKS); groups "
            "whose rewards are all equal are replaced by groups of tasks not yet run in that iteration, until N "
            "are informative or --resample-budget is spent; the flat ones are not trained on (rollout/"
            "informative.py)."
        ),
    )
    resample_budget: int | None = field(
        default=None,
        metadata=option(
            "With --min-informative-groups N: at most M replacement groups per iteration (default: N)."
        ),
    )
    resume: bool = field(
        default=False,
        metadata=option(
            "Carry on the run in RUN (killed or stopped) with its recorded command: `--resume -o RUN`.",
            "--resume",
        ),
    )
    keep_checkpoints: int | None = field(
        default=None,
        metadata=option("Keep the weights of the last N trainings only (the newest is what --resume needs)."),
    )
    # Tasks with a `judge` (polar_mitm/judges/): rollout's JudgeOptions, the same declarations.
    judge_url: str | None = field(default=None, metadata=field_metadata(JudgeOptions, "judge_url"))
    judge_model: str = field(
        default=JudgeOptions.judge_model, metadata=field_metadata(JudgeOptions, "judge_model")
    )
    judge_api_key_env: str = field(
        default=JudgeOptions.judge_api_key_env, metadata=field_metadata(JudgeOptions, "judge_api_key_env")
    )
    judge_timeout: float = field(
        default=JudgeOptions.judge_timeout, metadata=field_metadata(JudgeOptions, "judge_timeout")
    )
    judge_retries: int = field(
        default=JudgeOptions.judge_retries, metadata=field_metadata(JudgeOptions, "judge_retries")
    )
    judge_concurrency: int = field(
        default=JudgeOptions.judge_concurrency, metadata=field_metadata(JudgeOptions, "judge_concurrency")
    )
    judge_failure: JudgeFailure = field(
        default=JudgeOptions.judge_failure, metadata=field_metadata(JudgeOptions, "judge_failure")
    )
    judge_budget: int = field(
        default=JudgeOptions.judge_budget, metadata=field_metadata(JudgeOptions, "judge_budget")
    )
    yes: bool = field(
        default=False,
        metadata=option(
            "With --resume: run the harness RUN/run.json records even where it is not this command line's "
            "--harness (the command stops showing both otherwise).",
            "--yes",
        ),
    )

    def end_rules(self) -> EndRules:
        """The `--on-*` rules, as the merge applies them (zero gives the rollout's failure reward)."""
        rules = {end: EndRule(getattr(self, f"on_{end}")) for end in RULED_ENDS}
        return EndRules(rules, failure_reward=RolloutConfig.failure_reward)

    def judge_options(self) -> JudgeOptions:
        """The judge settings, as rollout takes them (polar_mitm/judges/options.py)."""
        return JudgeOptions(**{f: getattr(self, f) for f in JudgeOptions.__dataclass_fields__})
