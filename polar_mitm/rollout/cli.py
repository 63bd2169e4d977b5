"""`polar-mitm rollout`: run G harness sessions per task through the gateway and write rewards (the loop's command,
which shares `capture_stack`, `load_inputs`, `fail` and the harness option, is polar_mitm/loop/cli.py).

Its options are generated (polar_mitm/config_options.py) from `RolloutCommandOptions` (the inputs, outputs and stack)
and `RolloutConfig` (how the sessions run, rollout/runner.py), each field declared once with its help."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live

from polar_mitm.config_options import ConfigOptionsCommand, field_options, option, option_values
from polar_mitm.engine.script import ScriptError
from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines import router
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.judges.judging import JudgeFailed, JudgePlaces, judge_problem, judge_sessions
from polar_mitm.judges.options import JudgeOptions, judge_api_key
from polar_mitm.log_format import LOG_FORMAT_HELP, EventLog, LogFormat, events_stdout, resolved
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec, HarnessSpecError
from polar_mitm.rollout.runner import Rollout, RolloutConfig, RolloutSummary, write_rewards
from polar_mitm.rollout.view import SessionEvents, render, summary_rows, summary_table
from polar_mitm.storage.judgments import JUDGE_CACHE_DIR, JUDGMENTS_DIR
from polar_mitm.storage.location import private_dir
from polar_mitm.tasks.task_file import Task, TaskFileError, load_tasks

console = Console(width=None if sys.stdout.isatty() else 140)  # full tables in logs and CI too

# The groups of `rollout`'s generated options (`option_values`): RolloutCommandOptions' and RolloutConfig's fields.
ROLLOUT_OPTIONS, SESSION_OPTIONS, JUDGE_OPTIONS = "rollout", "sessions", "judges"
SESSIONS_PANEL = "Sessions (RolloutConfig)"
JUDGES_PANEL = "Judges (JudgeOptions: tasks with a `judge`)"


@dataclass(frozen=True)
class RolloutCommandOptions:
    """What `polar-mitm rollout` is told beside its RolloutConfig: the tasks and harness, where records and rewards
    go, and the engine and gateways the sessions run against. Each field is an option of its help."""

    tasks: Path = field(metadata=option("Task file (JSONL).", argument=True))
    harness: str = field(
        default="sdk:openai_chat", metadata=option("sdk:PROVIDER | cmd:TEMPLATE | preset name.")
    )
    out: Path = field(
        default=Path("flows"), metadata=option("Record directory (the gateway's polar_out).", "--out", "-o")
    )
    gateways: int = field(
        default=1,
        metadata=option("Gateway processes started (sessions spread across them, records under OUT/gw-*)."),
    )
    rewards: Path = field(
        default=Path("rewards.parquet"), metadata=option("Rewards file (.parquet or .jsonl).")
    )
    engine_url: str | None = field(
        default=None, metadata=option("Engine URL to use (default: start one).", "--engine")
    )
    model: str = field(default="tiny", metadata=option("Model for a started engine."))
    script: Path | None = field(
        default=None, metadata=option("Scripted policy for a started engine (tests/demo).")
    )
    gateway_url: str | None = field(
        default=None, metadata=option("Attach to a running gateway (reverse URL).")
    )
    gateway_proxy: str | None = field(default=None, metadata=option("… and its HTTPS_PROXY listener."))
    work_dir: Path = field(
        default=Path("runs/rollout"), metadata=option("Workspaces, logs, mitmproxy confdir.")
    )
    ray_address: str | None = field(
        default=None,
        metadata=option(
            "Run on this Ray cluster (auto | HOST:PORT | local): one gateway per node, records under "
            "OUT/node-NAME/.",
            "--ray",
        ),
    )
    max_attempts: int = field(default=2, metadata=option("--ray: runs of a session whose node died."))
    max_tokens: int | None = field(
        default=None,
        metadata=option(
            "Completion budget of every model call (the gateway's polar_max_tokens; default: the harness's own, "
            "capped at 8192)."
        ),
    )
    temperature: float | None = field(
        default=None,
        metadata=option(
            "Sampling temperature forced on every call (polar_temperature; default: the harness's)."
        ),
    )

    log_format: LogFormat = field(default=LogFormat.auto, metadata=option(LOG_FORMAT_HELP))

    def check(self) -> None:
        """A gateway count or sampling setting the command cannot apply ends it with one line."""
        if self.gateways < 1 or (self.gateways > 1 and (self.ray_address is not None or self.gateway_url)):
            raise fail(
                "--gateways must be at least 1, and is 1 with --ray (one gateway per node) or --gateway-url"
            )
        if self.gateway_url and self.sampling_options():
            raise fail(
                "--max-tokens/--temperature are set on the gateway this attaches to (--set polar_max_tokens=N "
                "--set polar_temperature=T), not here"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise fail(f"--max-tokens {self.max_tokens}: must be at least 1")
        if self.temperature is not None and not 0 <= self.temperature < float("inf"):
            raise fail(f"--temperature {self.temperature}: must be a finite number ≥ 0")

    def sampling_options(self) -> dict[str, str]:
        """The gateway options that force this rollout's sampling settings on every call."""
        options = {}
        if self.max_tokens is not None:
            options["polar_max_tokens"] = str(self.max_tokens)
        if self.temperature is not None:
            options["polar_temperature"] = str(self.temperature)
        return options


class RolloutCommand(ConfigOptionsCommand):
    """`polar-mitm rollout`: RolloutCommandOptions' fields, then RolloutConfig's (`rollout_settings`)."""

    def generated_options(self) -> dict[str, list]:
        return {
            ROLLOUT_OPTIONS: field_options(RolloutCommandOptions),
            SESSION_OPTIONS: field_options(RolloutConfig, panel=SESSIONS_PANEL),
            JUDGE_OPTIONS: field_options(JudgeOptions, panel=JUDGES_PANEL),
        }


def rollout_settings(ctx: typer.Context) -> tuple[RolloutCommandOptions, RolloutConfig]:
    """`polar-mitm rollout`'s parsed options: the command's own, and the RolloutConfig of the rest (its workspaces
    and logs under --work-dir)."""
    given = RolloutCommandOptions(**option_values(ctx, ROLLOUT_OPTIONS))
    config = RolloutConfig(
        **option_values(ctx, SESSION_OPTIONS),
        workspace_root=given.work_dir / "workspaces",
        log_dir=given.work_dir / "logs",
    )
    return given, config


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


def load_inputs(tasks_file: Path, harness: str, script: Path | None = None) -> tuple[list[Task], HarnessSpec]:
    """The task file, the harness and the scripted policy it would meet, checked before anything starts; bad ones
    end the command with one line."""
    try:
        tasks, spec = load_tasks(tasks_file), HarnessSpec(harness)
        if script is not None:
            spec.check_script(script)
        return tasks, spec
    except TaskFileError as exc:
        raise fail(str(exc)) from None
    except HarnessSpecError as exc:
        raise fail(f"--harness: {exc}") from None
    except ScriptError as exc:
        raise fail(str(exc)) from None


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
    log_format: LogFormat | str = LogFormat.auto,
) -> RolloutSummary:
    """Run the rollout, shown as `log_format` says (a live view on a terminal, else a line per finished session);
    raises Interrupted (with the finished sessions) when a signal stops it."""
    started, received = time.monotonic(), []
    rollout = Rollout(tasks, harness, endpoints, config)
    shown = resolved(log_format, console.is_terminal)
    try:
        if shown is LogFormat.rich:
            with Live(render([], started), console=console, refresh_per_second=4) as view:
                rollout.on_update = lambda sessions: view.update(render(sessions, started))
                return asyncio.run(_until_signal(rollout, received))
        rollout.on_update = SessionEvents(EventLog(shown, started=started), len(rollout.sessions)).update
        return asyncio.run(_until_signal(rollout, received))
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise Interrupted(received[0] if received else signal.SIGINT, rollout.finished()) from None


def rollout_command(ctx: typer.Context) -> None:
    """Run G sessions per task (INIT → READY → RUN → POST-RUN → teardown) and write their rewards."""
    given, config = rollout_settings(ctx)
    task_list, harness_spec = load_inputs(given.tasks, given.harness, given.script)
    given.check()
    judging = JudgeOptions(**option_values(ctx, JUDGE_OPTIONS))
    if (problem := judge_problem(task_list, judging)) is not None:
        raise fail(problem)
    judge_api_key(judging.judge_api_key_env)  # out of the environment before any session inherits it
    if given.engine_url is not None and given.gateway_url is None:  # before any session: each would score 0.0
        try:
            router.check_answering(given.engine_url)
        except router.EngineUnreachable as exc:
            raise fail(str(exc)) from None
    private_dir(given.work_dir)  # owner-only: logs, workspaces, grading state
    if given.ray_address is not None:
        ray_rollout(
            task_list,
            given.harness,
            config,
            given.ray_address,
            out=given.out,
            rewards=given.rewards,
            engine=given.engine_url,
            model=given.model,
            script=given.script,
            work_dir=given.work_dir,
            max_attempts=given.max_attempts,
            gateway_options=given.sampling_options(),
            # the nodes' harness logs are under WORK_DIR/logs/NODE (judging looks one folder down)
            judge=lambda summary: judged(
                summary, judging, given, replace(config, log_dir=given.work_dir / "logs")
            ),
        )
    else:
        with events_stdout(resolved(given.log_format, console.is_terminal)):
            local_rollout(task_list, harness_spec, config, given, judging)


def judged(
    summary: RolloutSummary, judging: JudgeOptions, given: RolloutCommandOptions, config: RolloutConfig
) -> None:
    """Tasks with a `judge`: their sessions' rewards combined with the judge's scores (polar_mitm/judges/), the
    judgments under WORK_DIR/judgments, the cache under WORK_DIR/judge-cache; a failing judge under
    `--judge-failure fail` ends the command (exit 1) before any rewards are written."""
    places = JudgePlaces(
        records=given.out,
        judgments=given.work_dir / JUDGMENTS_DIR,
        cache=given.work_dir / JUDGE_CACHE_DIR,
        harness_logs=config.log_dir,
    )
    try:
        counts = judge_sessions(summary.sessions, judging, places)
    except JudgeFailed as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if counts.sessions or counts.failed:
        typer.echo(counts.line(judging.judge_failure), err=True)


def local_rollout(
    task_list: list[Task],
    harness: HarnessSpec,
    config: RolloutConfig,
    given: RolloutCommandOptions,
    judging: JudgeOptions | None = None,
) -> None:
    """The sessions on this machine, against the gateways started (or attached to) for them."""
    try:
        with capture_stack(
            given.out,
            engine=given.engine_url,
            model=given.model,
            script=given.script,
            gateway_url=given.gateway_url,
            gateway_proxy=given.gateway_proxy,
            ca_bundle=None,
            work=given.work_dir,
            gateway_options=given.sampling_options(),
            gateways=given.gateways,
        ) as (endpoints, _):
            summary = run_rollout(task_list, harness, config, endpoints, log_format=given.log_format)
    except Interrupted as stop:
        # Finished sessions keep their rewards; the interrupted ones get none (merge drops their records).
        write_rewards(stop.summary, given.rewards, given.out)
        stopped = sum(s.status == "cancelled" for s in stop.summary.sessions)
        typer.echo(
            f"interrupted by {stop}: {len(stop.summary.sessions) - stopped} finished session(s), {stopped} "
            f"cancelled → rewards {given.rewards}",
            err=True,
        )
        raise typer.Exit(128 + stop.signum) from None
    judged(summary, judging or JudgeOptions(), given, config)
    write_rewards(summary, given.rewards, given.out)
    closing = (
        f"{len(summary.sessions)} sessions in {summary.wall_seconds:.1f}s, RUN utilisation "
        f"{summary.run_utilisation:.0%} → rewards {given.rewards}, records {given.out}"
    )
    if resolved(given.log_format, console.is_terminal) is LogFormat.json:  # stdout stays JSON lines
        EventLog(LogFormat.json).event(
            "finished",
            closing,
            sessions=len(summary.sessions),
            wall_s=round(summary.wall_seconds, 1),
            run_utilisation=summary.run_utilisation,
            rewards=str(given.rewards),
            records=str(given.out),
            tasks=summary_rows(summary.sessions),
        )
        return
    console.print(summary_table(summary.sessions))
    console.print(closing)


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
