"""`polar-mitm serve-rollouts`: the rollout service on one machine — an engine (given, or the embedded one started),
gateways in front of it recording to OUT/flows, and the HTTP routes of server.py (uvicorn) that any trainer calls.

The token comes from `POLAR_SERVICE_TOKEN` and is taken out of this process's environment before any session
starts, so no harness inherits it. Without one the service listens on loopback only, and says so.

The judge of tasks with evaluator strategy `rubric` (`--judge-url`, `--judge-model`, `--judge-failure`, …) is
`polar-mitm rollout`'s: the same declarations (judges/options.py, JudgeOptions), generated here too.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from polar_mitm.config_options import ConfigOptionsCommand, field_options, option_values
from polar_mitm.judges.options import JudgeOptions, judge_api_key
from polar_mitm.service import RESULTS_IN_MEMORY_TOKENS, TOKEN_ENV
from polar_mitm.user_errors import UserInputError

SHUTDOWN_GRACE_S = 5  # a request still running when the service is stopped gets this long
JUDGE_OPTIONS = "judges"  # the group of generated options: JudgeOptions' fields
JUDGES_PANEL = "Judges (JudgeOptions: tasks of evaluator strategy rubric)"


class ServiceCommand(ConfigOptionsCommand):
    """`serve-rollouts` with `--config FILE.yaml` and `--show-config`, as rollout, loop and grpo have them (its own
    options hand-written, the judge's generated from JudgeOptions)."""

    def generated_options(self) -> dict[str, list]:
        return {JUDGE_OPTIONS: field_options(JudgeOptions, panel=JUDGES_PANEL)}


def serve_rollouts_command(
    ctx: typer.Context,
    engine: Annotated[
        str | None, typer.Option(help="Engine URL[,URL…] (default: start the embedded one).")
    ] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="The embedded engine's model.")] = "tiny",
    script: Annotated[
        Path | None, typer.Option(help="Scripted policy for the embedded engine (tests).")
    ] = None,
    host: Annotated[str, typer.Option(help="Listen address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Listen port.")] = 8700,
    out: Annotated[Path, typer.Option("--out", "-o", help="Records, task states, workspaces.")] = Path(
        "runs/service"
    ),
    task_root: Annotated[
        Path | None, typer.Option(help="Where a relative metadata.workspace.dir is found (default: cwd).")
    ] = None,
    max_sessions: Annotated[int, typer.Option(help="Harness sessions running at once.")] = 8,
    queue_limit: Annotated[int, typer.Option(help="Tasks waiting before a submit gets 429.")] = 64,
    results_in_memory: Annotated[
        int,
        typer.Option(
            help="Trace tokens of finished tasks' results kept in memory for GET /rollout/task/ID (~76 bytes "
            "each); beyond it the oldest finished tasks' results are read back from OUT/tasks/*/results.jsonl."
        ),
    ] = RESULTS_IN_MEMORY_TOKENS,
    gateways: Annotated[int, typer.Option(help="Gateway processes (sessions spread across them).")] = 1,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            help="Sessions on this Ray cluster's rollout nodes (auto | HOST:PORT | local), one gateway per node "
            "recording under OUT/flows/node-NAME (instead of --gateways here).",
        ),
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="Completion budget forced on every call (polar_max_tokens).")
    ] = None,
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature forced on every call (polar_temperature).")
    ] = None,
    sandbox: Annotated[
        str,
        typer.Option(help="Where each session runs: none | bwrap | podman | docker (recipes/sandboxes.md)."),
    ] = "bwrap",
    image: Annotated[str | None, typer.Option(help="The container image of --sandbox podman|docker.")] = None,
    resume: Annotated[
        bool, typer.Option(help="Carry on the tasks under --out: report what finished, re-run the rest.")
    ] = False,
) -> None:
    """Serve rollouts in Polar's wire format: POST /rollout/task/submit, GET|DELETE /rollout/task/ID, /events."""
    from polar_mitm.gateway.exposure import is_loopback
    from polar_mitm.storage import service_layout as layout

    token = os.environ.pop(TOKEN_ENV, None) or None  # out of the environment every session inherits
    if token is None and not is_loopback(host):
        raise UserInputError(f"--host {host}: beyond loopback the service needs a token; set {TOKEN_ENV}")
    for flag, value in (
        ("--max-sessions", max_sessions),
        ("--queue-limit", queue_limit),
        ("--gateways", gateways),
    ):
        if value < 1:
            raise UserInputError(f"{flag} {value}: must be at least 1")
    tasks_dir = out / layout.TASKS_DIR
    if not resume and tasks_dir.exists() and any(tasks_dir.iterdir()):
        raise UserInputError(
            f"--out {out} holds an earlier service's tasks: pass --resume, or choose another folder"
        )
    if resume and not tasks_dir.exists():
        raise UserInputError(f"--resume: {out} holds no service tasks ({tasks_dir} is missing)")
    if max_tokens is not None and max_tokens < 1:
        raise UserInputError(f"--max-tokens {max_tokens}: must be at least 1")
    if temperature is not None and not 0 <= temperature < float("inf"):
        raise UserInputError(f"--temperature {temperature}: must be a finite number ≥ 0")
    if results_in_memory < 0:
        raise UserInputError(f"--results-in-memory {results_in_memory}: must be at least 0 (0: none kept)")
    sampling = {
        name: str(value)
        for name, value in (("polar_max_tokens", max_tokens), ("polar_temperature", temperature))
        if value is not None
    }
    if ray is not None and gateways != 1:
        raise UserInputError("--ray with --gateways: each Ray node runs one gateway of its own")
    if engine is not None:
        from polar_mitm.engines import router

        router.check_answering(engine)
    from polar_mitm.sandbox import get_sandbox

    get_sandbox(sandbox, image)  # one that cannot run here: a one-line error before anything starts
    judging = JudgeOptions(**option_values(ctx, JUDGE_OPTIONS))
    judge_api_key(judging.judge_api_key_env)  # out of the environment before any session inherits it
    if (problem := judging.problem()) is not None:
        raise UserInputError(problem)
    run_service(
        out=out,
        engine=engine,
        model=model,
        script=script,
        host=host,
        port=port,
        token=token,
        task_root=(task_root or Path.cwd()).resolve(),
        max_sessions=max_sessions,
        queue_limit=queue_limit,
        results_in_memory=results_in_memory,
        gateways=gateways,
        ray=ray,
        resume=resume,
        sampling=sampling,
        sandbox=(sandbox, image),
        judging=judging,
    )


def run_service(*, out: Path, engine, model, script, host, port, token, task_root, **options) -> None:
    import uvicorn

    from polar_mitm.engines import processes as engine_processes
    from polar_mitm.engines import router
    from polar_mitm.service.jobs import RolloutService
    from polar_mitm.service.server import build_app
    from polar_mitm.storage import service_layout as layout
    from polar_mitm.storage.location import private_dir

    private_dir(out)
    work = out / layout.WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    with (
        engine_processes.engine_running(
            engine,
            model=model,
            log=work / "engine.log",
            extra_args=["--script", str(script)] if script else [],
        ) as engine_url,
        router.attached(engine_url, log=work / "router.log") as attached,
        session_places(out, attached.url, options) as (endpoints, sessions, gateway_options),
    ):
        service = RolloutService(
            out,
            endpoints,
            task_root=task_root,
            max_sessions=options["max_sessions"],
            queue_limit=options["queue_limit"],
            results_in_memory=options["results_in_memory"],
            engine_url=attached.url,
            sampling=options["sampling"],
            gateway_options=gateway_options,
            sessions=sessions,
            sandbox=options["sandbox"],
            judging=options["judging"],
        )
        if options["resume"]:
            rerun = service.resume()
            typer.echo(f"resumed {service.task_count()} task(s) from {out}: {rerun} session(s) to run again")
        auth = (
            "bearer token required" if token else f"no token: loopback only (set {TOKEN_ENV} to require one)"
        )
        typer.echo(f"rollout service on http://{host}:{port} ({auth}); records → {out / layout.FLOWS_DIR}")
        config = uvicorn.Config(
            build_app(service, token, stopping=lambda: server.should_exit),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            # asyncio's loop, not uvloop: each session starts processes, and uvloop's spawn is a full fork() of
            # this process where CPython's is a vfork (2.4 vs 1.15 ms a process measured idle, more under load): the
            # service's largest cost over the in-process runner (benchmarks/bench_service.py: +9.9 → +2.7 ms)
            loop="asyncio",
        )
        server = uvicorn.Server(config)
        server.run()


@contextmanager
def session_places(out: Path, engine_url: str, options: dict):
    """Where the service's sessions run: (the gateways here, None), or with `--ray` ([], RaySessions on the
    cluster's nodes, each starting its own gateway); and the options every gateway is given — the sampling forced
    on each call, and what the engines need (`router.gateway_options`, as the loop and `rollout --ray` give them:
    behind a router, the tokenizer for token-exact prompts)."""
    import secrets as token_source

    from polar_mitm.engines import router
    from polar_mitm.gateway import processes as gateway_processes
    from polar_mitm.rollout.harness_spec import GatewayEndpoints
    from polar_mitm.service.jobs import runner_config
    from polar_mitm.service.sessions import RaySessions
    from polar_mitm.storage import service_layout as layout

    work = out / layout.WORK_DIR
    gateway_options = {**router.gateway_options(engine_url), **options["sampling"]}
    if options["ray"] is not None:
        yield (
            [],
            RaySessions(
                options["ray"],
                engine_url=engine_url,
                gateway_options=gateway_options,
                config=runner_config(work, options["max_sessions"], options["sandbox"]),
                flows=out / layout.FLOWS_DIR,
                work=work,
            ),
            gateway_options,
        )
        return
    with gateway_processes.gateways_running(
        router.gateway_backends(engine_url, options["gateways"]),
        out / layout.FLOWS_DIR,
        confdir=work / "mitmproxy",
        log=work / "gateway.log",
        options=gateway_options or None,
        session_key=token_source.token_urlsafe(32),
    ) as started:
        yield [GatewayEndpoints.of(gw) for gw in started], None, gateway_options
