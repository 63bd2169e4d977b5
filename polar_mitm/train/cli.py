"""The training commands: `polar-mitm grpo`, `sync`, `plot`, `sft` (registered on the app in polar_mitm/cli.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 140)  # full tables in logs and CI too


def grpo_command(
    data: Annotated[list[Path], typer.Option("--data", help="Merged shards: a directory of *.parquet (repeatable).")],
    output_dir: Annotated[Path, typer.Option("--output-dir", "-o", help="Run directory (checkpoints, metrics).")] = (
        Path("runs/grpo")),
    model: Annotated[str, typer.Option("--model", "-m", help="Checkpoint directory, or `tiny` / `smollm2`.")] = "tiny",
    lora: Annotated[bool, typer.Option(help="Train LoRA adapters instead of all weights.")] = False,
    lora_r: Annotated[int, typer.Option(help="LoRA rank.")] = 16,
    lora_alpha: Annotated[int, typer.Option(help="LoRA alpha.")] = 32,
    lora_target_modules: Annotated[str, typer.Option(help="LoRA target modules (comma list or all-linear).")] = (
        "all-linear"),
    save_merged: Annotated[bool, typer.Option(help="With --lora, also write the merged model to OUTPUT/merged.")] = (
        True),
    max_steps: Annotated[int, typer.Option(help="Optimizer steps (-1: --epochs over the data).")] = -1,
    epochs: Annotated[float, typer.Option(help="Passes over the data when --max-steps is -1.")] = 1.0,
    max_length: Annotated[int | None, typer.Option(help="Keep the first L tokens of each sequence.")] = None,
    learning_rate: Annotated[float, typer.Option(help="AdamW learning rate.")] = 1e-6,
    lr_scheduler: Annotated[str, typer.Option(help="transformers scheduler name (linear, constant, cosine, …).")] = (
        "linear"),
    warmup_steps: Annotated[int, typer.Option(help="Linear warm-up steps.")] = 0,
    per_device_batch_size: Annotated[int, typer.Option(help="Sequences per device per micro-step.")] = 8,
    gradient_accumulation_steps: Annotated[int, typer.Option(help="Micro-steps per optimizer step.")] = 1,
    num_generations: Annotated[int | None, typer.Option(
        help="Expected sessions per task_id (group size check).")] = None,
    strict_group_size: Annotated[bool, typer.Option(help="Fail if a group has another size.")] = False,
    temperature: Annotated[float, typer.Option(
        help="Sampling temperature of rows that recorded none (v1 data); others are scored at their own.")] = 1.0,
    keep_truncated_sampling: Annotated[bool, typer.Option(
        help="Keep greedy and top-p/top-k/min-p-truncated calls in the loss (default: context only, counted).")] = (
        False),
    session_weighting: Annotated[bool, typer.Option(
        help="grpo/sapo: one unit of weight per session, shared by its sequences.")] = True,
    behaviour_logp_tolerance: Annotated[float, typer.Option(
        help="Report rows whose mean |recomputed - recorded| logprob exceeds this (nats).")] = 0.1,
    drop_mismatched_rows: Annotated[bool, typer.Option(
        help="Leave rows above --behaviour-logp-tolerance out of the loss.")] = False,
    loss_type: Annotated[str, typer.Option(help="dapo | grpo | dr_grpo | bnpo | cispo | sapo | luspo | vespo.")] = (
        "dapo"),
    epsilon: Annotated[float, typer.Option(help="Lower clip range of the ratio.")] = 0.2,
    epsilon_high: Annotated[float | None, typer.Option(help="Upper clip range (default: --epsilon).")] = None,
    beta: Annotated[float, typer.Option(help="KL coefficient to the starting model (0: no reference).")] = 0.0,
    advantage: Annotated[str, typer.Option(help="mean_std | leave_one_out.")] = "mean_std",
    scale_rewards: Annotated[str, typer.Option(help="mean_std scaling: group | batch | none.")] = "group",
    importance_sampling_level: Annotated[str, typer.Option(help="Ratio per token or per sequence (GSPO).")] = (
        "token"),
    num_iterations: Annotated[int, typer.Option(help="Optimizer passes over each batch (PPO epochs).")] = 1,
    stale_correction: Annotated[str, typer.Option(
        help="token_truncate | token_mask | sequence_truncate | sequence_mask | none.")] = "token_truncate",
    stale_is_clip_max: Annotated[float, typer.Option(help="Truncation of the stale-rollout weight.")] = 2.0,
    policy_weight_version: Annotated[str | None, typer.Option(
        help="weight_version of --model (default: the newest in the data).")] = None,
    push_to_engine: Annotated[str | None, typer.Option(help="Engine URL to load the new weights.")] = None,
    push_every_steps: Annotated[int, typer.Option(help="Also push every N steps (0: only at the end).")] = 0,
    save_steps: Annotated[int, typer.Option(help="Intermediate checkpoints every N steps (0: none).")] = 0,
    report_to: Annotated[str, typer.Option(help="tensorboard | none | wandb | … (comma list).")] = "tensorboard",
    bf16: Annotated[bool, typer.Option(help="bf16 autocast (GPU).")] = False,
    activation_checkpointing: Annotated[bool, typer.Option(help="Trade compute for memory.")] = False,
    seed: Annotated[int, typer.Option(help="Seed for data order and initialisation.")] = 0,
) -> None:
    """GRPO on merged shards (TRL): group-relative advantages per task_id, loss on sampled tokens only, ratios
    against the recorded behaviour logprobs; writes a Hugging Face checkpoint, metrics.jsonl and TensorBoard logs."""
    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.train.data import build_training_data, read_merged
    from polar_mitm.train.grpo_config import PolarGRPOConfig
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
    from polar_mitm.train.sync import attach_engine_push

    model_dir = resolve_model(model)
    sequences = read_merged(data)
    train_data = build_training_data(sequences, estimator=advantage, scale_rewards=scale_rewards,  # type: ignore[arg-type]
                                     max_length=max_length, group_size=num_generations,
                                     keep_truncated_sampling=keep_truncated_sampling)
    if is_main_process():
        print_data_stats(train_data.stats.to_dict())
    config = PolarGRPOConfig(
        output_dir=str(output_dir),
        max_steps=max_steps, num_train_epochs=epochs, max_length=max_length, learning_rate=learning_rate,
        lr_scheduler_type=lr_scheduler, warmup_steps=warmup_steps, per_device_train_batch_size=per_device_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps, group_size=num_generations,
        strict_group_size=strict_group_size, temperature=temperature, keep_truncated_sampling=keep_truncated_sampling,
        session_weighting=session_weighting, behaviour_logp_tolerance=behaviour_logp_tolerance,
        drop_mismatched_rows=drop_mismatched_rows, loss_type=loss_type, epsilon=epsilon,
        epsilon_high=epsilon_high, beta=beta, advantage_estimator=advantage, scale_rewards=scale_rewards,
        importance_sampling_level=importance_sampling_level, num_iterations=num_iterations,
        stale_correction=stale_correction, stale_is_clip_max=stale_is_clip_max,
        policy_weight_version=policy_weight_version, push_to_engine=push_to_engine,
        push_every_steps=push_every_steps, save_merged=save_merged,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[] if report_to == "none" else report_to.split(","), bf16=bf16,
        activation_checkpointing=activation_checkpointing, seed=seed,
    )
    peft_config = None
    if lora:
        from peft import LoraConfig

        targets = lora_target_modules if lora_target_modules == "all-linear" else lora_target_modules.split(",")
        peft_config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, target_modules=targets, task_type="CAUSAL_LM")
    trainer = PolarGRPOTrainer(str(model_dir), args=config, train_data=train_data, peft_config=peft_config)
    attach_engine_push(trainer)
    trainer.train()
    saved = trainer.save_final()
    if trainer.accelerator.is_main_process:
        (output_dir / "data_stats.json").write_text(json.dumps(train_data.stats.to_dict(), indent=2))
        (output_dir / "grpo_config.json").write_text(config.to_json_string())
        # What a caller that launched us as processes (the loop's --train-processes) needs to go on.
        (output_dir / "result.json").write_text(json.dumps({
            **{name: str(path) for name, path in saved.items()},
            "weight_version": trainer.policy_weight_version(), "steps": trainer.state.global_step,
            "processes": trainer.accelerator.num_processes}))
        for name, path in saved.items():
            console.print(f"[green]{name}[/] → {path}")
        console.print(f"metrics → {output_dir / config.metrics_file} (TensorBoard: {output_dir / 'runs'}); "
                      f"plot with `polar-mitm plot {output_dir}`")
        if push_to_engine:
            console.print(f"[green]engine[/] {push_to_engine} now serves weight_version "
                          f"{trainer.policy_weight_version()}")


def sync_command(
    engine: Annotated[str, typer.Option("--engine", help="Engine base URL (SGLang or polar-mitm serve).")],
    model: Annotated[Path, typer.Option("--model", "-m", help="Checkpoint directory the engine can read.")],
    weight_version: Annotated[str | None, typer.Option(help="Version to report (default: the engine's +1).")] = None,
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
    out: Annotated[Path | None, typer.Option("--out", "-o", help="PNG path (default RUN/plots/curves.png).")] = None,
) -> None:
    """Plot a run's metrics (loss, reward, advantages, clip ratio, KL, importance ratios, staleness, tokens/s)."""
    from polar_mitm.train.metrics import plot_run

    console.print(f"[green]curves[/] → {plot_run(run, out)}")


def sft_command(
    data: Annotated[list[Path], typer.Option("--data", help="Merged shards (repeatable).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory.")],
    min_reward: Annotated[float, typer.Option(help="Keep sessions whose reward is at least this.")] = 1.0,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Tokenizer for the messages form "
                                                                    "(checkpoint dir, tiny, smollm2).")] = None,
) -> None:
    """Export successful trajectories for SFTTrainer: pre-tokenised (ids + assistant_masks + labels) and, with a
    ChatML tokenizer, messages + tools; prints the acceptance table."""
    from polar_mitm.train.data import read_merged
    from polar_mitm.train.sft import export_sft

    tokenizer = None
    if model is not None:
        from transformers import AutoTokenizer

        from polar_mitm.engine.model_zoo import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    export = export_sft(read_merged(data), output, min_reward=min_reward, tokenizer=tokenizer)
    table = Table(title=f"SFT export (reward ≥ {min_reward})")
    for column in ("task", "attempted", "accepted", "rate", "sequences", "sampled tokens"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for row in [*export.per_task, export.total]:
        table.add_row(row.name, str(row.attempted), str(row.accepted), f"{row.rate:.1%}", str(row.sequences),
                      str(row.sampled_tokens))
    console.print(table)
    console.print(f"[green]tokenized[/] → {output / 'tokenized'}")
    if export.messages_rows is not None:
        console.print(f"[green]messages[/] → {output / 'messages'} ({export.messages_rows} rows; "
                      f"{export.messages_skipped} did not render back to their token ids)")


def is_main_process() -> bool:
    """Rank 0 under torchrun / accelerate launch (before the trainer exists to say so)."""
    return os.environ.get("RANK", "0") == "0"


def print_data_stats(stats: dict) -> None:
    table = Table(title="training data", show_header=False)
    for key, value in stats.items():
        table.add_row(key, str(value))
    console.print(table)
