"""`polar-mitm vllm serve MODEL`: vLLM on a model directory (or `tiny`, `smollm2`) with the project's flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from polar_mitm.engine.tool_call_formats import (
    DEFAULT_TOOL_CALL_PARSER,
    TOOL_CALL_PARSER_NAMES,
    tool_call_format,
)

vllm_app = typer.Typer(
    help="vLLM as the engine (its own venv: bash scripts/setup-vllm.sh)", no_args_is_help=True
)


@vllm_app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="model directory, or tiny (head_dim 32 variant) / smollm2")],
    port: Annotated[int, typer.Option(help="port of vLLM's OpenAI server")] = 30000,
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    device: Annotated[str, typer.Option(help="cpu (fp32, eager) or gpu (bf16, prefix caching)")] = "cpu",
    script: Annotated[
        Path | None,
        typer.Option(help="scripted test policy (engine/script.py's format; the logprobs stay the model's)"),
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(
            help="file (mode 600) holding the API key every route but /health needs (else $POLAR_ENGINE_KEY); "
            "without a key only sampling routes answer and weight pushes are off"
        ),
    ] = None,
    tool_call_parser: Annotated[
        str,
        typer.Option(
            help=f"the model family's tool-call notation: {' | '.join(TOOL_CALL_PARSER_NAMES)} (the gateway "
            "parses with it; vLLM's own parser of that notation is set too)"
        ),
    ] = DEFAULT_TOOL_CALL_PARSER,
) -> None:
    """Run vLLM in the foreground; arguments after the options go to `vllm serve` unchanged."""
    from polar_mitm.engines import keys as engine_keys
    from polar_mitm.vllm.server import VllmNotInstalled, exec_vllm

    if device not in ("cpu", "gpu"):
        raise typer.BadParameter("--device must be cpu or gpu")
    if any(arg == "--tool-call-parser" or arg.startswith("--tool-call-parser=") for arg in ctx.args):
        typer.echo(
            "polar-mitm: give the parser as polar-mitm vllm serve --tool-call-parser NAME (before any --), "
            "so that the gateway parses with it too",
            err=True,
        )
        raise typer.Exit(2)
    tool_call_format(tool_call_parser)  # an unknown name: one line, exit 2
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in ctx.args):
        typer.echo(
            "polar-mitm: give the key with --api-key-file PATH (a command line is readable by all)", err=True
        )
        raise typer.Exit(2)
    try:
        api_key = engine_keys.read_key_file(api_key_file) if api_key_file else engine_keys.process_key()
    except engine_keys.KeyFileError as exc:
        typer.echo(f"polar-mitm: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        exec_vllm(
            model,
            port=port,
            host=host,
            device=device,  # type: ignore[arg-type]
            extra_args=list(ctx.args),
            script=script,
            api_key=api_key,
            tool_call_parser=tool_call_parser,
        )
    except VllmNotInstalled as exc:
        typer.echo(f"polar-mitm: {exc}", err=True)
        raise typer.Exit(2) from exc
