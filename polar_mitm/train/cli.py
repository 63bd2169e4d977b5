"""The training commands: `polar-mitm grpo`, `sync`, `plot`, `sft` (registered on the app in polar_mitm/cli.py).

`polar-mitm grpo`'s options are generated from `PolarGRPOConfig` (`GrpoCommand`, train/config_options.py); only
what is not a config field (the data, the model, LoRA, how to spell checkpointing and logging) is declared here. What a
GRPO run is built from (its rows, LoRA and config) is train/run.py's, which the loop uses too.
"""

from __future__ import annotations

import json
import os
import sys
import typing
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

if typing.TYPE_CHECKING:
    pass

from polar_mitm.config_options import option_values
from polar_mitm.storage.run_layout import TRAINING_RESULT_FILE
from polar_mitm.train.config_options import GRPO_OPTIONS, LORA_HELP, TRL_PANEL
from polar_mitm.train.run import grpo_config, lora_config, training_data

console = Console(width=None if sys.stdout.isatty() else 140)  # full tables in logs and CI too


def grpo_command(
    ctx: typer.Context,
    data: Annotated[
        list[Path], typer.Option("--data", help="Merged shards: a directory of *.parquet (repeatable).")
    ],
    output_dir: Annotated[
        Path, typer.Option("--output-dir", "--out", "-o", help="Run directory (checkpoints, metrics).")
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
    overwrite: Annotated[
        bool, typer.Option(help="Replace a finished training already at --output-dir (else refused).")
    ] = False,
) -> None:
    """GRPO on merged shards (TRL): group-relative advantages per task_id, loss on sampled tokens only, ratios
    against the recorded behaviour logprobs; writes a Hugging Face checkpoint, metrics.jsonl and TensorBoard logs."""
    from polar_mitm.train.tracker_imports import skip_unrequested_tracker_imports

    skip_unrequested_tracker_imports(report_to.split(","))  # before TRL is imported
    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.train.data import load_sequences
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
    from polar_mitm.train.learning_rate import default_learning_rate
    from polar_mitm.train.sync import attach_engine_push

    fields = option_values(ctx, GRPO_OPTIONS)
    if (
        not overwrite
        and not fields.get("resume_from_checkpoint")
        and (output_dir / TRAINING_RESULT_FILE).exists()
    ):
        typer.echo(  # a finished training (its checkpoint, metrics and logs) was replaced without a word before
            f"error: --output-dir {output_dir} already holds a finished training; pass --overwrite to replace it, "
            "or choose another folder",
            err=True,
        )
        raise typer.Exit(2)
    if fields.get("push_to_engine"):  # before the training: a push target found dead after it loses the run
        from polar_mitm.engines import router

        try:
            router.check_answering(fields["push_to_engine"], option="--push-to-engine")
        except router.EngineUnreachable as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    train_data = training_data(
        load_sequences(data), fields
    )  # first: a bad --data is said before any model work
    model_dir = resolve_model(model)
    if fields.get("learning_rate") is None:
        fields["learning_rate"], said = default_learning_rate(model_dir)
        if is_main_process():
            console.print(said)
    config = grpo_config(fields, output_dir=output_dir, save_steps=save_steps, report_to=report_to)
    peft_config = lora_config(lora_r, lora_alpha, lora_target_modules) if lora else None
    trainer = PolarGRPOTrainer(str(model_dir), args=config, train_data=train_data, peft_config=peft_config)
    if is_main_process():  # after the batch plan, which adds its counts (split_groups, zero_advantage_*)
        print_data_stats(train_data.stats.to_dict())
    attach_engine_push(trainer)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    saved = trainer.save_final()
    if trainer.accelerator.is_main_process:
        (output_dir / "data_stats.json").write_text(json.dumps(train_data.stats.to_dict(), indent=2))
        (output_dir / "grpo_config.json").write_text(config.to_json_string())
        # What a caller that launched us as processes (the loop's --train-processes) needs to go on.
        (output_dir / TRAINING_RESULT_FILE).write_text(
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
    from polar_mitm.engines.dialects.base import EngineSyncError
    from polar_mitm.engines.weights import push_weights

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
    output: Annotated[Path, typer.Option("--output", "--out", "-o", help="Output directory.")],
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
    """The data summary as data_stats.json has it (printed once the trainer's batch plan has added its counts)."""
    table = Table(title="training data", show_header=False)
    for key, value in stats.items():
        table.add_row(key, str(value))
    console.print(table)
