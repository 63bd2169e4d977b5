"""`polar-mitm agent`, also runnable as `python -m polar_mitm.agent.cli`: the reference SDK agent's command.

A module of its own so a rollout session starts it without importing the rest of the CLI (the loop, the trainer,
pyarrow, pandas): that import was about a second of CPU per session, more than the demo model's compute.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 140)


def agent(
    prompt: Annotated[str, typer.Argument(help="The task for the agent.")],
    provider: Annotated[
        str, typer.Option(help="openai_chat | openai_responses | anthropic | google")
    ] = "openai_chat",
    base_url: Annotated[str | None, typer.Option(help="Provider base URL (default: the SDK's own).")] = None,
    api_key: Annotated[
        str, typer.Option(envvar="POLAR_AGENT_API_KEY", help="API key to send.")
    ] = "polar-agent",
    workdir: Annotated[Path, typer.Option(help="Where shell commands run.")] = Path("."),
    max_turns: Annotated[int, typer.Option(help="Model calls at most.")] = 8,
    stream: Annotated[bool, typer.Option(help="Ask for SSE streams.")] = True,
) -> None:
    """A minimal reference coding agent on the official SDKs: one `shell` tool, run for real in WORKDIR."""
    from polar_mitm.agent.sdk_agent import DRIVERS, shell_runner

    result = DRIVERS[provider](
        prompt,
        api_key=api_key,
        base_url=base_url,
        stream=stream,
        max_turns=max_turns,
        run_tool=shell_runner(str(workdir)),
    )
    console.print(f"[bold]{result.calls} model calls[/], ran {len(result.tool_commands)} commands")
    console.print(result.final_text)


if __name__ == "__main__":
    typer.run(agent)
