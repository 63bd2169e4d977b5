"""`polar-mitm`: capture → reconstruct → train, one command per step."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from polar_mitm.agent.cli import agent
from polar_mitm.engine.cli import ModelOpt, serve

app = typer.Typer(
    help=__doc__,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every subcommand
)
console = Console(width=None if sys.stdout.isatty() else 140)  # full tables in logs and CI too


def _print_version(value: bool) -> None:
    if value:
        from polar_mitm import __version__

        typer.echo(f"polar-mitm {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help="Show the traceback of a mistake in the input too (else one line; $POLAR_DEBUG=1).",
        ),
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_print_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """capture → reconstruct → train, one command per step."""
    if debug:
        from polar_mitm.user_errors import DEBUG_ENV

        os.environ[DEBUG_ENV] = "1"  # children (the gateway, sessions' helpers) show theirs too


@app.command("tiny-model")
def tiny_model(
    out_dir: Annotated[Path, typer.Argument(help="Where to write the checkpoint.")],
    seed: Annotated[int, typer.Option(help="Weight seed; same seed, same bytes.")] = 0,
) -> None:
    """Write a tiny random-weight Qwen3-style model with Qwen's real tokenizer (offline, deterministic)."""
    from polar_mitm.engine.tiny_model import build_tiny_model

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    path = build_tiny_model(out_dir, seed=seed)
    console.print(f"[green]tiny model written to[/] {path}")


app.command()(serve)  # its own module: engines start it without the rest of the CLI (engine/cli.py)


@app.command("chat")
def chat_once(
    prompt: Annotated[str, typer.Argument(help="The user message.")] = "What is the capital of France?",
    engine_url: Annotated[str, typer.Option("--engine", help="Engine base URL.")] = "http://127.0.0.1:30000",
    max_tokens: Annotated[int, typer.Option(help="Completion budget.")] = 48,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 0.0,
) -> None:
    """Send one chat request to an engine and print the completion with its token ids and logprobs."""
    from polar_mitm.demo import print_chat

    print_chat(engine_url, prompt, max_tokens=max_tokens, temperature=temperature, console=console)


@app.command()
def demo(
    model: ModelOpt = "smollm2",
    prompt: Annotated[str, typer.Option(help="The user message.")] = "What is the capital of France?",
    port: Annotated[int, typer.Option(help="Engine port (0 = pick a free one).")] = 0,
    loop_model: Annotated[
        str, typer.Option(help="Model of the RL loop (tiny uses the scripted choice policy).")
    ] = ("tiny"),
    iterations: Annotated[
        int,
        typer.Option(
            help="RL loop training iterations, then a rollout of the trained policy (0 = only the chat)."
        ),
    ] = 4,
    run_dir: Annotated[
        Path, typer.Option(help="Where the loop's records, sequences and checkpoints go.")
    ] = Path("runs/demo"),
    learning_rate: Annotated[float, typer.Option(help="GRPO learning rate of the loop.")] = 3e-3,
    seed: Annotated[
        int, typer.Option(help="Seed of the loop's trainer and of the tiny model's initial weights.")
    ] = 0,
) -> None:
    """The main job on CPU: a real model answers with ids + logprobs, then rollout → merge → GRPO → push, looped."""
    from polar_mitm.demo import run_demo

    run_demo(
        model=model,
        prompt=prompt,
        port=port,
        console=console,
        loop_model=loop_model,
        iterations=iterations,
        run_dir=run_dir,
        learning_rate=learning_rate,
        seed=seed,
    )


@app.command("report")
def report_command(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            metavar="RUN_DIR",
            help="A loop run (`runs/demo`), or a rollout, merge or grpo directory; or several folders of one "
            "hand-run pipeline, in any order (`flows/ merged/ runs/grpo`: records, merged, grpo), for one report.",
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="HTML file (default: report.html in the (first) RUN_DIR)."),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="Tokenizer for the token viewer (default: the engine's, as the gateway recorded it)."
        ),
    ] = None,
    sessions: Annotated[int, typer.Option(help="Sessions shown in the token viewer.")] = 6,
) -> None:
    """Write one self-contained HTML report (no server, no network): iterations, curves, records, merge, tasks, tokens.

    Several RUN_DIRs (a hand-run rollout → merge → grpo) make one report with the sections each folder gives.
    """
    from polar_mitm.report import write_report

    # A RUN_DIR of no kind (or two of one kind): one line and exit 2 (main).
    path = write_report(run_dirs, out, tokenizer=tokenizer, sessions=sessions)
    console.print(f"report → {path}")


app.command()(agent)  # its own module: rollout sessions start it without the rest of the CLI


@app.command("import-flows")
def import_flows_command(
    flows: Annotated[list[Path], typer.Argument(help="mitmproxy flow files (`mitmdump -w`).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Record directory.")] = Path("flows"),
) -> None:
    """Turn recorded flows whose responses carry token ids into records.

    A file cut short (mitmdump killed) or a flow whose record does not validate is named on stderr, one line
    each, and everything readable is still imported. Exit code 1 when something was not imported and nothing
    was; 0 otherwise (with those lines as warnings).
    """
    from polar_mitm.gateway.import_flows import import_flow_files
    from polar_mitm.terminal import markup_safe, printable

    result = import_flow_files(flows, out)
    for problem in result.problems:
        typer.echo(f"warning: {printable(problem)}", err=True)
    counts = result.counts
    not_imported = f", {len(result.problems)} not imported (see above)" if result.problems else ""
    console.print(
        f"records: {counts['gateway']} from gateway flows, {counts['engine']} from engine flows, "
        f"{counts['skipped']} flows skipped{not_imported} → {markup_safe(result.shard)}"
    )
    if result.problems and result.shard is None:
        raise typer.Exit(1)


@app.command("records")
def records_command(
    out: Annotated[Path, typer.Argument(help="Record directory (`polar_out`).")] = Path("flows"),
    limit: Annotated[int, typer.Option(help="Rows to show.")] = 20,
) -> None:
    """List recorded model calls (compacted shards and the live journal)."""
    from rich.table import Table

    from polar_mitm.storage.location import InputNotFound, Location
    from polar_mitm.storage.records import scan_records
    from polar_mitm.terminal import markup_safe, plain

    if not Location.of(out).exists:  # an empty table and exit 0 would read as "the gateway recorded nothing"
        raise InputNotFound(f"{out}: no such record folder (the gateway's `polar_out`)")
    found = scan_records(out)
    for problem in found.problems:  # skipped, one line each naming the file: the rest is still listed
        console.print(f"[yellow]{markup_safe(problem)}[/]", soft_wrap=True)
    rows = found.table.to_pylist()
    table = Table(title=f"{len(rows)} records in {markup_safe(out)}")
    for col in ("session_id", "task_id", "seq", "provider", "stream", "prompt", "sampled", "finish", "error"):
        table.add_column(col)
    for r in sorted(rows, key=lambda r: (r["session_id"], r["seq"]))[:limit]:
        # Ids and errors come from harnesses and engines: shown as text, never as markup or escape sequences.
        table.add_row(
            plain(r["session_id"]),
            plain(r["task_id"] or ""),
            str(r["seq"]),
            plain(r["provider"]),
            str(r["stream"]),
            str(len(r["prompt_ids"] or [])),
            str(len(r["completion_ids"] or [])),
            plain(r["finish_reason"]),
            plain((r["error"] or "")[:40]),
        )
    console.print(table)


def _register_subcommands() -> None:
    from polar_mitm.loop.cli import LoopCommand, loop_command
    from polar_mitm.rollout.cli import RolloutCommand, rollout_command

    app.command("rollout", cls=RolloutCommand)(rollout_command)  # options generated from its configs
    app.command("loop", cls=LoopCommand)(loop_command)  # + every `grpo` option (generated on first use)


_register_subcommands()


def _register_reconstruct() -> None:
    from polar_mitm.reconstruct.cli import merge_command, show_command, stats_command

    app.command("merge")(merge_command)
    app.command("show")(show_command)
    app.command("stats")(stats_command)


_register_reconstruct()


def _register_harness() -> None:
    from polar_mitm.harness.cli import harness_app

    app.add_typer(harness_app, name="harness")


_register_harness()


def _register_tasks() -> None:
    from polar_mitm.tasks.cli import tasks_app

    app.add_typer(tasks_app, name="tasks")


_register_tasks()


def _register_train() -> None:
    from polar_mitm.train.cli import grpo_command, plot_command, sft_command, sync_command
    from polar_mitm.train.config_options import GrpoCommand

    app.command("grpo", cls=GrpoCommand)(grpo_command)
    app.command("sync")(sync_command)
    app.command("plot")(plot_command)
    app.command("sft")(sft_command)


_register_train()


def _register_config() -> None:
    from polar_mitm.config_file import config_app

    app.add_typer(config_app, name="config")


_register_config()


def _register_service() -> None:
    from polar_mitm.service.cli import ServiceCommand, serve_rollouts_command

    app.command("serve-rollouts", cls=ServiceCommand)(
        serve_rollouts_command
    )  # the rollout service (Polar's wire format)


_register_service()


def _register_dashboard() -> None:
    from polar_mitm.dashboard.cli import dashboard_command

    app.command("dashboard")(dashboard_command)  # the live web view of a run directory


_register_dashboard()


def _register_vllm() -> None:
    from polar_mitm.vllm.cli import vllm_app

    app.add_typer(vllm_app, name="vllm")


_register_vllm()


def _register_gateway_and_doctor() -> None:
    from polar_mitm.doctor import doctor_command
    from polar_mitm.gateway.foreground import gateway_command

    app.command("gateway")(gateway_command)  # the gateway in the foreground, with the hook-ups printed
    app.command("doctor")(doctor_command)  # what this machine has, and what fixes the rest


_register_gateway_and_doctor()


def main(argv: list[str] | None = None) -> None:
    """The `polar-mitm` command: `app`, with a mistake in the user's input said in one line and exit 2
    (`polar_mitm.user_errors`); any other exception is ours and keeps its traceback."""
    from polar_mitm.user_errors import run_command

    run_command(app, argv, "polar-mitm")


if __name__ == "__main__":
    main()
