"""`polar-mitm rollout`: run G harness sessions per task through the gateway and write rewards (the loop's command,
which shares `capture_stack`, `load_inputs` and `fail`, is polar_mitm/loop/cli.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live

from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines import router
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec, HarnessSpecError
from polar_mitm.rollout.runner import Rollout, RolloutConfig, RolloutSummary, write_rewards
from polar_mitm.rollout.view import render, summary_table
from polar_mitm.storage.location import private_dir
from polar_mitm.tasks.task_file import Task, TaskFileError, load_tasks

console = Console(width=None if sys.stdout.isatty() else 140)  # full tables in logs and CI too

# `rollout`'s options that are RolloutConfig fields (their defaults are the config's; a test checks the rest).
ROLLOUT_FIELDS = (
    "group_size",
    "concurrency",
    "keep",
    "ready_buffer",
    "init_workers",
    "post_workers",
    "failure_reward",
    "keep_workspaces",
)


def help_of(config: type, name: str) -> str:
    """A config field's help (`metadata["help"]`), for the command-line option that sets it."""
    return {f.name: f for f in dataclasses.fields(config)}[name].metadata["help"]


@contextmanager
def capture_stack(
    out: Path,
    *,
    engine: str | None,
    model: str,
    script: Path | None,
    gateway_url: str | None,
    gateway_proxy: str | None,
    ca_bundle: Path | None,
    work: Path,
    gateway_options=None,
    gateways: int = 1,
):
    """Attach to a running gateway, or start engine (unless given) + `gateways` gateways for the duration; yields
    (the gateways' endpoints, the engine URL)."""
    if gateway_url:
        yield [GatewayEndpoints(gateway_url, gateway_proxy, ca_bundle)], engine
        return
    with (
        engine_processes.engine_running(
            engine,
            model=model,
            log=work / "engine.log",
            extra_args=["--script", str(script)] if script else [],
        ) as engine_url,
        gateway_processes.gateways_running(
            router.gateway_backends(engine_url, gateways),
            out,
            confdir=work / "mitmproxy",
            log=work / "gateway.log",
            options=gateway_options,
            session_key=secrets.token_urlsafe(32),  # each session's calls carry a credential under it
        ) as started,
    ):
        yield [GatewayEndpoints.of(gw) for gw in started], engine_url


class Interrupted(Exception):
    """The rollout was stopped by a signal; `summary` holds the sessions that finished before it."""

    def __init__(self, signum: int, summary: RolloutSummary) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.summary = signum, summary


def fail(message: str) -> typer.Exit:
    """A one-line error on stderr (no traceback, no Rich markup: the text may quote a task file) and exit 2."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def load_inputs(tasks_file: Path, harness: str) -> tuple[list[Task], HarnessSpec]:
    """The task file and the harness, checked before anything starts; bad ones end the command with one line."""
    try:
        return load_tasks(tasks_file), HarnessSpec(harness)
    except TaskFileError as exc:
        raise fail(str(exc)) from None
    except HarnessSpecError as exc:
        raise fail(f"--harness: {exc}") from None


async def _until_signal(rollout: Rollout, received: list[int]) -> RolloutSummary:
    """Run the rollout; SIGINT/SIGTERM cancel it (the runner then stops its harnesses) and are noted in `received`."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()

    def stop(signum: int) -> None:
        received.append(signum)
        if task is not None:
            task.cancel()

    installed = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
            loop.add_signal_handler(signum, stop, signum)
            installed.append(signum)
    try:
        return await rollout.run()
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)


def run_rollout(
    tasks: list[Task],
    harness: HarnessSpec,
    config: RolloutConfig,
    endpoints: GatewayEndpoints | list[GatewayEndpoints],
    *,
    live: bool = True,
) -> RolloutSummary:
    """Run the rollout; raises Interrupted (with the finished sessions) when a signal stops it."""
    started, received = time.monotonic(), []
    rollout = Rollout(tasks, harness, endpoints, config)
    try:
        if live and console.is_terminal:
            with Live(render([], started), console=console, refresh_per_second=4) as view:
                rollout.on_update = lambda sessions: view.update(render(sessions, started))
                return asyncio.run(_until_signal(rollout, received))
        return asyncio.run(_until_signal(rollout, received))
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise Interrupted(received[0] if received else signal.SIGINT, rollout.finished()) from None


def rollout_command(
    tasks: Annotated[Path, typer.Argument(help="Task file (JSONL).")],
    harness: Annotated[
        str, typer.Option(help="sdk:PROVIDER | cmd:TEMPLATE | preset name.")
    ] = "sdk:openai_chat",
    group_size: Annotated[
        int, typer.Option("--group-size", "-g", help=help_of(RolloutConfig, "group_size"))
    ] = (RolloutConfig.group_size),
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", help=help_of(RolloutConfig, "concurrency"))
    ] = (RolloutConfig.concurrency),
    out: Annotated[Path, typer.Option(help="Record directory (the gateway's polar_out).")] = Path("flows"),
    gateways: Annotated[
        int,
        typer.Option(help="Gateway processes started (sessions spread across them, records under OUT/gw-*)."),
    ] = 1,
    rewards: Annotated[Path, typer.Option(help="Rewards file (.parquet or .jsonl).")] = Path(
        "rewards.parquet"
    ),
    keep: Annotated[int | None, typer.Option(help=help_of(RolloutConfig, "keep"))] = (RolloutConfig.keep),
    ready_buffer: Annotated[
        int, typer.Option(help=help_of(RolloutConfig, "ready_buffer"))
    ] = RolloutConfig.ready_buffer,
    init_workers: Annotated[
        int, typer.Option(help=help_of(RolloutConfig, "init_workers"))
    ] = RolloutConfig.init_workers,
    post_workers: Annotated[
        int, typer.Option(help=help_of(RolloutConfig, "post_workers"))
    ] = RolloutConfig.post_workers,
    failure_reward: Annotated[float, typer.Option(help=help_of(RolloutConfig, "failure_reward"))] = (
        RolloutConfig.failure_reward
    ),
    engine: Annotated[str | None, typer.Option(help="Engine URL to use (default: start one).")] = None,
    model: Annotated[str, typer.Option(help="Model for a started engine.")] = "tiny",
    script: Annotated[
        Path | None, typer.Option(help="Scripted policy for a started engine (tests/demo).")
    ] = None,
    gateway_url: Annotated[
        str | None, typer.Option(help="Attach to a running gateway (reverse URL).")
    ] = None,
    gateway_proxy: Annotated[str | None, typer.Option(help="… and its HTTPS_PROXY listener.")] = None,
    work_dir: Annotated[Path, typer.Option(help="Workspaces, logs, mitmproxy confdir.")] = Path(
        "runs/rollout"
    ),
    keep_workspaces: Annotated[bool, typer.Option(help=help_of(RolloutConfig, "keep_workspaces"))] = (
        RolloutConfig.keep_workspaces
    ),
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            help="Run on this Ray cluster (auto | HOST:PORT | local): one gateway per node, records under "
            "OUT/node-NAME/.",
        ),
    ] = None,
    max_attempts: Annotated[int, typer.Option(help="--ray: runs of a session whose node died.")] = 2,
) -> None:
    """Run G sessions per task (INIT → READY → RUN → POST-RUN → teardown) and write their rewards."""
    given = locals()  # the options, by name (before any other local)
    task_list, harness_spec = load_inputs(tasks, harness)
    private_dir(work_dir)  # owner-only: logs, workspaces, grading state
    config = RolloutConfig(
        **{name: given[name] for name in ROLLOUT_FIELDS},
        workspace_root=work_dir / "workspaces",
        log_dir=work_dir / "logs",
    )
    if gateways < 1 or (gateways > 1 and (ray is not None or gateway_url)):
        raise fail(
            "--gateways must be at least 1, and is 1 with --ray (one gateway per node) or --gateway-url"
        )
    if ray is not None:
        ray_rollout(
            task_list,
            harness,
            config,
            ray,
            out=out,
            rewards=rewards,
            engine=engine,
            model=model,
            script=script,
            work_dir=work_dir,
            max_attempts=max_attempts,
        )
        return
    try:
        with capture_stack(
            out,
            engine=engine,
            model=model,
            script=script,
            gateway_url=gateway_url,
            gateway_proxy=gateway_proxy,
            ca_bundle=None,
            work=work_dir,
            gateways=gateways,
        ) as (endpoints, _):
            summary = run_rollout(task_list, harness_spec, config, endpoints)
    except Interrupted as stop:
        # Finished sessions keep their rewards; the interrupted ones get none (merge drops their records).
        write_rewards(stop.summary, rewards)
        typer.echo(
            f"interrupted by {stop}: {len(stop.summary.sessions)} finished session(s) → rewards {rewards}",
            err=True,
        )
        raise typer.Exit(128 + stop.signum) from None
    write_rewards(summary, rewards)
    console.print(summary_table(summary.sessions))
    console.print(
        f"{len(summary.sessions)} sessions in {summary.wall_seconds:.1f}s, RUN utilisation "
        f"{summary.run_utilisation:.0%} → rewards {rewards}, records {out}"
    )


def ray_rollout(task_list: list[Task], harness: str, config: RolloutConfig, address: str, **options) -> None:
    """`rollout --ray`: the sessions on a Ray cluster; the same rewards file, plus which node ran what."""
    from polar_mitm.rollout.ray_runner import ray_rollout_command

    result = ray_rollout_command(task_list, harness, config, address=address, **options)
    for line in result.lines():
        console.print(line, markup=False)
    summary = result.summary
    if result.interrupted is not None:
        typer.echo(
            f"interrupted: {len(summary.sessions)} finished session(s) → rewards {options['rewards']}",
            err=True,
        )
        raise typer.Exit(128 + result.interrupted)
    console.print(summary_table(summary.sessions))
    console.print(
        f"{len(summary.sessions)} sessions in {summary.wall_seconds:.1f}s, RUN utilisation "
        f"{summary.run_utilisation:.0%} → rewards {options['rewards']}, records {options['out']}/node-*"
    )
