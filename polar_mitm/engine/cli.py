"""`polar-mitm serve`: the embedded CPU engine behind SGLang's HTTP contract, as a command of its own module.

Every rollout, loop and test starts engines (`engines/processes.py`), and importing the whole `polar-mitm` CLI first
(every subcommand's module) cost each start ~0.6 s of CPU on top of the engine's own imports. So the command lives
here: `polar_mitm.cli` registers it, and `python -m polar_mitm.engine.cli [serve options]` runs it alone.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from polar_mitm.engine.tool_call_formats import TOOL_CALL_PARSER_NAMES, tool_call_format

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Checkpoint directory, or `tiny` / `smollm2`.")]
console = Console(width=None if sys.stdout.isatty() else 140)  # full lines in logs too


def serve(
    model: ModelOpt = "tiny",
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (SGLang's default is 30000).")] = 30000,
    served_model_name: Annotated[str | None, typer.Option(help="Model name reported to clients.")] = None,
    context_length: Annotated[int | None, typer.Option(help="Override the model's context length.")] = None,
    tool_call_parser: Annotated[
        str | None,
        typer.Option(
            help=f"{' | '.join(TOOL_CALL_PARSER_NAMES)} (default: the model's).", show_default=False
        ),
    ] = None,
    reasoning_parser: Annotated[str | None, typer.Option(help="qwen3 | none (default: the model's).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the `tiny` model.")] = 0,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            envvar="OMP_NUM_THREADS",  # OpenMP's own variable, which torch honours too: one setting for both
            help="torch intra-op threads (default: $OMP_NUM_THREADS, else all cores).",
            show_default=False,
        ),
    ] = None,
    script: Annotated[
        Path | None, typer.Option(help="Test-only scripted policy (JSON list of turns).")
    ] = None,
    token_delay: Annotated[
        float, typer.Option(help="Test knob: seconds to wait before each sampled token.")
    ] = 0.0,
    first_token_delay: Annotated[
        float, typer.Option(help="Test knob: seconds to hold the first token back (a slow prefill).")
    ] = 0.0,
    stream_weight_version: Annotated[
        bool, typer.Option(help="Test knob: off, streamed answers omit their weight_version (as SGLang's).")
    ] = True,
    on_push: Annotated[
        str,
        typer.Option(
            help="What a weight push does to a running generation: swap (the new weights from its next token) "
            "or abort (SGLang's default: the call ends with finish abort and the gateway resumes it)."
        ),
    ] = "swap",
    api_key_file: Annotated[
        Path | None,
        typer.Option(
            help="File (mode 600) holding the API key every route but /health needs; without a key (nor "
            "$POLAR_ENGINE_KEY) only sampling routes answer and weight pushes are off."
        ),
    ] = None,
) -> None:
    """Serve a model on CPU behind SGLang's HTTP contract (the subset polar-mitm uses)."""
    import os

    from polar_mitm.engines import keys as engine_keys

    if tool_call_parser is not None:
        tool_call_format(tool_call_parser)  # before the model loads: an unknown name is said at once
    from polar_mitm.engine.server import ON_PUSH

    if on_push not in ON_PUSH:
        typer.echo(
            f"polar-mitm serve: --on-push must be one of {' | '.join(ON_PUSH)}, not {on_push!r}", err=True
        )
        raise typer.Exit(2)
    try:  # before the model loads: a bad key file is said at once
        api_key = engine_keys.read_key_file(api_key_file) if api_key_file else engine_keys.process_key()
    except engine_keys.KeyFileError as exc:
        typer.echo(f"polar-mitm serve: {exc}", err=True)
        raise typer.Exit(2) from exc

    import torch
    import uvicorn

    from polar_mitm.engine.generation import Engine
    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.engine.server import Pacing, build_app

    torch.set_num_threads(threads or os.cpu_count() or 1)
    path = resolve_model(model, seed=seed)
    engine = Engine(
        path,
        served_model_name=served_model_name,
        context_length=context_length,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        script_path=script,
    )
    console.print(
        f"[green]serving[/] {engine.served_model_name} ({path}) on http://{host}:{port} "
        f"context={engine.context_length} parsers={engine.tool_call_parser}/{engine.reasoning_parser}"
    )
    if api_key is None:
        console.print("[yellow]no API key[/] (--api-key-file): sampling routes only, weight pushes are off")
    pacing = Pacing(token_delay=token_delay, first_token_delay=first_token_delay)
    app = build_app(
        engine, pacing, api_key=api_key, stream_weight_version=stream_weight_version, on_push=on_push
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


def main(argv: list[str] | None = None) -> None:
    """`python -m polar_mitm.engine.cli`: `serve` alone (what `engines/processes.engine_running` starts)."""
    from polar_mitm.user_errors import run_command

    app = typer.Typer(
        pretty_exceptions_show_locals=False, context_settings={"help_option_names": ["-h", "--help"]}
    )
    app.command()(serve)
    run_command(app, argv, "polar-mitm serve")


if __name__ == "__main__":
    main()
