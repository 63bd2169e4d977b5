"""`polar-mitm grpo`'s generated options: every field `PolarGRPOConfig` adds to TRL's, and the TRL fields of
`TRL_OPTIONS`, each with the field's own help (`grpo_options`, built by polar_mitm/config_options.py). `polar-mitm grpo`
(`GrpoCommand`) and `polar-mitm loop` (loop/cli.py, but for the fields the loop sets itself) take them; `grpo_argv`
turns config values back into `grpo` options for the loop's `--train-processes` launches.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from polar_mitm.config_options import ConfigOptionsCommand, FieldOption, field_options
from polar_mitm.train.learning_rate import LEARNING_RATE_HELP

# TRL's fields that `polar-mitm grpo` exposes, spelt and defaulted as the command always had them (TRL's own help is
# written for sampling trainers). TRL's other ~150 fields keep PolarGRPOConfig's defaults: set them from Python.
TRL_OPTIONS: dict[str, FieldOption] = {
    "max_steps": FieldOption(help="Optimizer steps (-1: --epochs over the data)."),
    "num_train_epochs": FieldOption(
        ("--epochs",), default=1.0, help="Passes over the data when --max-steps is -1."
    ),
    "learning_rate": FieldOption(default=None, help=LEARNING_RATE_HELP),  # by model kind (learning_rate.py)
    "lr_scheduler_type": FieldOption(
        ("--lr-scheduler",), type=str, help="transformers scheduler name (linear, constant, cosine, …)."
    ),
    "warmup_steps": FieldOption(type=int, help="Linear warm-up steps."),
    "per_device_train_batch_size": FieldOption(
        ("--per-device-batch-size",), help="Sequences per device per micro-step."
    ),
    "gradient_accumulation_steps": FieldOption(help="Micro-steps per optimizer step."),
    "temperature": FieldOption(),  # PolarGRPOConfig redefines it (default and help)
    "loss_type": FieldOption(help="dapo | grpo | dr_grpo | bnpo | cispo | sapo | luspo | vespo."),
    "epsilon": FieldOption(help="Lower clip range of the ratio."),
    "epsilon_high": FieldOption(),  # redefined by PolarGRPOConfig (CISPO's own default)
    "delta": FieldOption(),  # redefined by PolarGRPOConfig (on by default)
    "beta": FieldOption(
        help="KL coefficient to the reference model (0: no reference): the run's initial model in `polar-mitm "
        "loop`, see --reference-model and --kl-estimator."
    ),
    "scale_rewards": FieldOption(help="mean_std scaling: group | batch | none."),
    "importance_sampling_level": FieldOption(help="Ratio per token or per sequence (GSPO)."),
    "num_iterations": FieldOption(help="Optimizer passes over each batch (PPO epochs)."),
    "bf16": FieldOption(),  # redefined by PolarGRPOConfig
    "activation_checkpointing": FieldOption(),  # redefined by PolarGRPOConfig
    "seed": FieldOption(default=0, help="Seed for data order and initialisation."),
    "resume_from_checkpoint": FieldOption(
        help="Continue a stopped run: a checkpoint-N directory, or `last` (the newest in --output-dir). Weights, "
        "optimizer, LR schedule, RNG and step come from it and the batches already trained are skipped; the "
        "behaviour check stays the one made at step 0 against the weights that sampled the data, and "
        "metrics.jsonl continues after the checkpoint's step (steps logged after it are dropped). Same data "
        "and options as the stopped run."
    ),
}


LORA_HELP = {
    "lora_r": "LoRA rank.",
    "lora_alpha": "LoRA alpha.",
    "lora_target_modules": "LoRA target modules (comma list or all-linear).",
}


# Polar's own fields are all options; these keep the names the command gave them before they were config fields.
RENAMED_OPTIONS: dict[str, FieldOption] = {
    "group_size": FieldOption(("--num-generations",)),
    "advantage_estimator": FieldOption(("--advantage",)),
}


TRL_PANEL = "Training (TRL's GRPOConfig)"


POLAR_PANEL = "Recorded rollouts (PolarGRPOConfig)"


GRPO_OPTIONS = (
    "grpo"  # the group of a command's generated options that are PolarGRPOConfig fields (`option_values`)
)


def polar_fields(config_class: type) -> list[dataclasses.Field]:
    """The fields `config_class` adds to TRL's `GRPOConfig` (redefined TRL fields are TRL's), in declaration order."""
    from trl import GRPOConfig

    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    return [f for f in dataclasses.fields(config_class) if f.name not in inherited]


def grpo_options(
    config_class: type,
    trl_options: dict[str, FieldOption] | None = None,
    exclude: typing.Collection[str] = (),
) -> list:
    """The command-line options of a GRPO config dataclass: the TRL fields of `trl_options` (spelt as it says), then
    every field the class adds to TRL's (spelt as `RENAMED_OPTIONS` says), with the field's default and
    `metadata["help"]` — but those in `exclude` (fields a command sets itself)."""
    trl_options = TRL_OPTIONS if trl_options is None else trl_options
    trl_names = [name for name in trl_options if name not in exclude]
    added = [f.name for f in polar_fields(config_class) if f.name not in exclude]
    return [
        *field_options(config_class, trl_names, overrides=trl_options, panel=TRL_PANEL),
        *field_options(config_class, added, overrides=RENAMED_OPTIONS, panel=POLAR_PANEL),
    ]


class GrpoCommand(ConfigOptionsCommand):
    """`polar-mitm grpo`: the options of `grpo_options(PolarGRPOConfig)`, as `option_values(ctx, GRPO_OPTIONS)`."""

    def generated_options(self) -> dict[str, list]:
        from polar_mitm.train.grpo_config import PolarGRPOConfig

        return {GRPO_OPTIONS: grpo_options(PolarGRPOConfig)}


def grpo_argv(fields: dict[str, Any]) -> list[str]:
    """`polar-mitm grpo` options that give these PolarGRPOConfig field values (those at the option's default are
    left out); a field that is no `grpo` option is refused."""
    from polar_mitm.train.grpo_config import PolarGRPOConfig

    params = {param.name: param for param in grpo_options(PolarGRPOConfig)}
    argv: list[str] = []
    for name, value in fields.items():
        param = params.get(name)
        if param is None:
            raise ValueError(f"{name} is not a `polar-mitm grpo` option")
        if value == param.default:
            continue
        if value is None:
            raise ValueError(
                f"{name}=None cannot be given as a `polar-mitm grpo` option (its default is {param.default})"
            )
        if param.is_flag:
            argv.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            argv += [param.opts[0], str(value)]
    return argv
