"""Command-line options generated from config dataclasses: every field of `PolarGRPOConfig` (and the TRL fields in
`TRL_OPTIONS`) is an option with the field's own help text. `polar-mitm grpo` (`GrpoCommand`) and `polar-mitm loop`
(`ConfigOptionsCommand`, loop/cli.py) take them; `grpo_argv` turns config values back into `grpo` options for the
loop's `--train-processes` launches.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

if typing.TYPE_CHECKING:
    pass


FIELD_DEFAULT: Any = object()  # a `FieldOption.default` that keeps the field's own


@dataclasses.dataclass(frozen=True)
class FieldOption:
    """How a config field reads on the command line where that differs from the field: flag, default, help, type."""

    flag: str | None = None  # default: --field-name
    default: Any = FIELD_DEFAULT
    help: str | None = None  # default: the field's `metadata["help"]`
    type: Any = None  # default: the field's annotation


# TRL's fields that `polar-mitm grpo` exposes, spelt and defaulted as the command always had them (TRL's own help is
# written for sampling trainers). TRL's other ~150 fields keep PolarGRPOConfig's defaults: set them from Python.
TRL_OPTIONS: dict[str, FieldOption] = {
    "max_steps": FieldOption(help="Optimizer steps (-1: --epochs over the data)."),
    "num_train_epochs": FieldOption(
        "--epochs", default=1.0, help="Passes over the data when --max-steps is -1."
    ),
    "learning_rate": FieldOption(help="AdamW learning rate."),
    "lr_scheduler_type": FieldOption(
        "--lr-scheduler", type=str, help="transformers scheduler name (linear, constant, cosine, …)."
    ),
    "warmup_steps": FieldOption(type=int, help="Linear warm-up steps."),
    "per_device_train_batch_size": FieldOption(
        "--per-device-batch-size", help="Sequences per device per micro-step."
    ),
    "gradient_accumulation_steps": FieldOption(help="Micro-steps per optimizer step."),
    "temperature": FieldOption(),  # PolarGRPOConfig redefines it (default and help)
    "loss_type": FieldOption(help="dapo | grpo | dr_grpo | bnpo | cispo | sapo | luspo | vespo."),
    "epsilon": FieldOption(help="Lower clip range of the ratio."),
    "epsilon_high": FieldOption(),  # redefined by PolarGRPOConfig (CISPO's own default)
    "delta": FieldOption(),  # redefined by PolarGRPOConfig (on by default)
    "beta": FieldOption(help="KL coefficient to the starting model (0: no reference)."),
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
    "group_size": FieldOption("--num-generations"),
    "advantage_estimator": FieldOption("--advantage"),
}


TRL_PANEL = "Training (TRL's GRPOConfig)"


POLAR_PANEL = "Recorded rollouts (PolarGRPOConfig)"


CONFIG_FIELDS = "polar_config_fields"  # ctx.meta key: the parsed config options, by field name


def polar_fields(config_class: type) -> list[dataclasses.Field]:
    """The fields `config_class` adds to TRL's `GRPOConfig` (redefined TRL fields are TRL's), in declaration order."""
    from trl import GRPOConfig

    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    return [f for f in dataclasses.fields(config_class) if f.name not in inherited]


def config_options(
    config_class: type,
    trl_options: dict[str, FieldOption] | None = None,
    renamed: dict[str, FieldOption] | None = None,
    exclude: typing.Collection[str] = (),
) -> list:
    """The command-line options (click parameters, built by Typer) of a GRPO config dataclass: the TRL fields of
    `trl_options`, then every field the class adds to TRL's, with the field's default and `metadata["help"]` —
    but those in `exclude` (fields a command sets itself)."""
    trl_options = TRL_OPTIONS if trl_options is None else trl_options
    renamed = RENAMED_OPTIONS if renamed is None else renamed
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    types = typing.get_type_hints(config_class)
    chosen = [(name, option, TRL_PANEL) for name, option in trl_options.items()]
    chosen += [(f.name, renamed.get(f.name, FieldOption()), POLAR_PANEL) for f in polar_fields(config_class)]
    chosen = [entry for entry in chosen if entry[0] not in exclude]
    parameters = []
    for name, option, panel in chosen:
        field = fields[name]
        help_text = option.help or field.metadata.get("help")
        if not help_text:
            raise ValueError(
                f"{config_class.__name__}.{name} has no metadata['help'] for its command-line option"
            )
        default = option.default
        if default is FIELD_DEFAULT:
            default = (
                field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
            )
        annotation = option.type or types[name]
        if default is not None:  # `bool | None = False` is a plain --flag/--no-flag
            annotation = _without_none(annotation)
        flags = [option.flag] if option.flag else []
        if flags and annotation is bool:
            flags = [f"{option.flag}/--no-{option.flag.removeprefix('--')}"]
        parameters.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=default,
                annotation=Annotated[annotation, typer.Option(*flags, help=help_text, rich_help_panel=panel)],
            )
        )

    def fields_only(**values: Any) -> None:
        """Never called: Typer reads its signature."""

    fields_only.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    builder = typer.Typer(add_completion=False)
    builder.command()(fields_only)
    return list(typer.main.get_command(builder).params)


def _without_none(annotation: Any) -> Any:
    args = typing.get_args(annotation)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]  # noqa: UP007
    return annotation


class ConfigOptionsCommand(TyperCommand):
    """A command with generated config options (`config_options()` of a subclass): they are added when the command
    is first parsed or helped, not when the app is built — importing TRL takes seconds that the other commands
    should not pay. Their values reach the command in `ctx.meta[CONFIG_FIELDS]`."""

    config_params: list | None = None

    def config_options(self) -> list:
        raise NotImplementedError

    def get_params(self, ctx: typer.Context) -> list:
        if self.config_params is None:
            self.config_params = self.config_options()
            self.params.extend(self.config_params)
        return super().get_params(ctx)

    def invoke(self, ctx: typer.Context) -> Any:
        ctx.meta[CONFIG_FIELDS] = {
            param.name: ctx.params.pop(param.name) for param in self.config_params or []
        }
        return super().invoke(ctx)


class GrpoCommand(ConfigOptionsCommand):
    """`polar-mitm grpo`: the options of `config_options(PolarGRPOConfig)`."""

    def config_options(self) -> list:
        from polar_mitm.train.grpo_config import PolarGRPOConfig

        return config_options(PolarGRPOConfig)


def grpo_argv(fields: dict[str, Any]) -> list[str]:
    """`polar-mitm grpo` options that give these PolarGRPOConfig field values (those at the option's default are
    left out); a field that is no `grpo` option is refused."""
    from polar_mitm.train.grpo_config import PolarGRPOConfig

    params = {param.name: param for param in config_options(PolarGRPOConfig)}
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
