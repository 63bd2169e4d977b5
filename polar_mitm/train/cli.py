"""The training commands: `polar-mitm grpo`, `sync`, `plot`, `sft` (registered on the app in polar_mitm/cli.py).

`polar-mitm grpo`'s options are generated from `PolarGRPOConfig` (`GrpoCommand`): every field Polar adds to TRL's
`GRPOConfig` is an option with the field's own help text, and so are the TRL fields listed in `TRL_OPTIONS`. Only
what is not a config field (the data, the model, LoRA, how to spell checkpointing and logging) is declared here.
`polar-mitm loop` gets the same generated options (`ConfigOptionsCommand`, rollout/cli.py), and `grpo_argv` turns
config values back into `grpo` options for the loop's `--train-processes` launches.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import typing
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperCommand

if typing.TYPE_CHECKING:
    from polar_mitm.train.grpo_config import PolarGRPOConfig

console = Console(width=None if sys.stdout.isatty() else 140)  # full tables in logs and CI too


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


def training_data(sequences: list, fields: dict[str, Any]):
    """The training rows of merged sequences under a config's data options (as `polar-mitm grpo` builds them)."""
    from polar_mitm.train.data import build_training_data

    return build_training_data(
        sequences,
        estimator=fields.get("advantage_estimator", "mean_std"),
        scale_rewards=fields.get("scale_rewards", "group"),
        max_length=fields.get("max_length"),
        group_size=fields.get("group_size"),
        keep_truncated_sampling=fields.get("keep_truncated_sampling", False),
    )


def lora_config(r: int, alpha: int, target_modules: str):
    """PEFT's LoraConfig from the LoRA options (`all-linear` or a comma list of module names)."""
    from peft import LoraConfig

    targets = target_modules if target_modules == "all-linear" else target_modules.split(",")
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, task_type="CAUSAL_LM")


def grpo_config(
    fields: dict[str, Any], *, output_dir: Path, save_steps: int, report_to: str
) -> PolarGRPOConfig:
    """The `PolarGRPOConfig` of a `polar-mitm grpo` call: its config options, and the few it spells its own way."""
    from polar_mitm.train.grpo_config import PolarGRPOConfig

    return PolarGRPOConfig(
        output_dir=str(output_dir),
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[] if report_to == "none" else report_to.split(","),
        **fields,
    )


def grpo_command(
    ctx: typer.Context,
    data: Annotated[
        list[Path], typer.Option("--data", help="Merged shards: a directory of *.parquet (repeatable).")
    ],
    output_dir: Annotated[
        Path, typer.Option("--output-dir", "-o", help="Run directory (checkpoints, metrics).")
    ] = (Path("runs/grpo")),
    model: Annotated[
        str, typer.Option("--model", "-m", help="Checkpoint directory, or `tiny` / `smollm2`.")
    ] = "tiny",
    lora: Annotated[bool, typer.Option(help="Train LoRA adapters instead of all weights.")] = False,
    lora_r: Annotated[int, typer.Option(help=LORA_HELP["lora_r"])] = 16,
    lora_alpha: Annotated[int, typer.Option(help=LORA_HELP["lora_alpha"])] = 32,
    lora_target_modules: Annotated[str, typer.Option(help=LORA_HELP["lora_target_modules"])] = ("all-linear"),
    save_steps: Annotated[
        int, typer.Option(help="Intermediate checkpoints every N steps (0: none).", rich_help_panel=TRL_PANEL)
    ] = 0,
    report_to: Annotated[
        str, typer.Option(help="tensorboard | none | wandb | … (comma list).", rich_help_panel=TRL_PANEL)
    ] = "tensorboard",
) -> None:
    """GRPO on merged shards (TRL): group-relative advantages per task_id, loss on sampled tokens only, ratios
    against the recorded behaviour logprobs; writes a Hugging Face checkpoint, metrics.jsonl and TensorBoard logs."""
    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.train.data import load_sequences
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
    from polar_mitm.train.sync import attach_engine_push

    fields = ctx.meta[CONFIG_FIELDS]
    model_dir = resolve_model(model)
    train_data = training_data(load_sequences(data), fields)
    if is_main_process():
        print_data_stats(train_data.stats.to_dict())
    config = grpo_config(fields, output_dir=output_dir, save_steps=save_steps, report_to=report_to)
    peft_config = lora_config(lora_r, lora_alpha, lora_target_modules) if lora else None
    trainer = PolarGRPOTrainer(str(model_dir), args=config, train_data=train_data, peft_config=peft_config)
    attach_engine_push(trainer)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    saved = trainer.save_final()
    if trainer.accelerator.is_main_process:
        (output_dir / "data_stats.json").write_text(json.dumps(train_data.stats.to_dict(), indent=2))
        (output_dir / "grpo_config.json").write_text(config.to_json_string())
        # What a caller that launched us as processes (the loop's --train-processes) needs to go on.
        (output_dir / "result.json").write_text(
            json.dumps(
                {
                    **{name: str(path) for name, path in saved.items()},
                    "weight_version": trainer.policy_weight_version(),
                    "steps": trainer.state.global_step,
                    "processes": trainer.accelerator.num_processes,
                }
            )
        )
        for name, path in saved.items():
            console.print(f"[green]{name}[/] → {path}")
        console.print(
            f"metrics → {output_dir / config.metrics_file} (TensorBoard: {output_dir / 'runs'}); "
            f"plot with `polar-mitm plot {output_dir}`"
        )
        if config.push_to_engine:
            console.print(
                f"[green]engine[/] {config.push_to_engine} now serves weight_version "
                f"{trainer.policy_weight_version()}"
            )


def sync_command(
    engine: Annotated[str, typer.Option("--engine", help="Engine base URL (SGLang or polar-mitm serve).")],
    model: Annotated[Path, typer.Option("--model", "-m", help="Checkpoint directory the engine can read.")],
    weight_version: Annotated[
        str | None, typer.Option(help="Version to report (default: the engine's +1).")
    ] = None,
) -> None:
    """Load a checkpoint into a running engine (POST /update_weights_from_disk) and print its new weight_version."""
    from polar_mitm.engines import EngineSyncError, push_weights

    try:
        version = push_weights(engine, model, weight_version=weight_version)
    except EngineSyncError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from exc
    console.print(f"[green]{engine}[/] serves {model} as weight_version {version}")


def plot_command(
    run: Annotated[Path, typer.Argument(help="Run directory (with metrics.jsonl).")],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="PNG path (default RUN/plots/curves.png).")
    ] = None,
) -> None:
    """Plot a run's metrics (loss, reward, advantages, clip ratio, KL, importance ratios, staleness, tokens/s)."""
    from polar_mitm.train.metrics import plot_run

    console.print(f"[green]curves[/] → {plot_run(run, out)}")


def sft_command(
    data: Annotated[list[Path], typer.Option("--data", help="Merged shards (repeatable).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory.")],
    min_reward: Annotated[float, typer.Option(help="Keep sessions whose reward is at least this.")] = 1.0,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="Tokenizer for the messages form (checkpoint dir, tiny, smollm2)."
        ),
    ] = None,
) -> None:
    """Export successful trajectories for SFTTrainer: pre-tokenised (ids + assistant_masks + labels) and, with a
    ChatML tokenizer, messages + tools; prints the acceptance table."""
    from polar_mitm.train.data import load_sequences
    from polar_mitm.train.sft import export_sft

    tokenizer = None
    if model is not None:
        from transformers import AutoTokenizer

        from polar_mitm.engine.model_zoo import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    export = export_sft(load_sequences(data), output, min_reward=min_reward, tokenizer=tokenizer)
    table = Table(title=f"SFT export (reward ≥ {min_reward})")
    for column in ("task", "attempted", "accepted", "rate", "sequences", "sampled tokens"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for row in [*export.per_task, export.total]:
        table.add_row(
            row.name,
            str(row.attempted),
            str(row.accepted),
            f"{row.rate:.1%}",
            str(row.sequences),
            str(row.sampled_tokens),
        )
    console.print(table)
    console.print(f"[green]tokenized[/] → {output / 'tokenized'}")
    if export.messages_rows is not None:
        console.print(
            f"[green]messages[/] → {output / 'messages'} ({export.messages_rows} rows; "
            f"{export.messages_skipped} did not render back to their token ids)"
        )


def is_main_process() -> bool:
    """Rank 0 under torchrun / accelerate launch (before the trainer exists to say so)."""
    return os.environ.get("RANK", "0") == "0"


def print_data_stats(stats: dict) -> None:
    table = Table(title="training data", show_header=False)
    for key, value in stats.items():
        table.add_row(key, str(value))
    console.print(table)
