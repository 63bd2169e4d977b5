"""`polar-mitm tasks …`: task files made from other formats (`tasks swe`: SWE-bench / SWE-Gym instance files;
`tasks harbor`: Harbor / Terminal-Bench task folders) and checked before training (`tasks check`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from polar_mitm.sandbox import DEFAULT_SANDBOX
from polar_mitm.tasks.swe import DEFAULT_PROMPT, InstanceError, SweOptions, load_instances, write_tasks
from polar_mitm.tasks.task_file import TaskFileError, load_tasks

tasks_app = typer.Typer(
    help="Make rollout task files (`tasks swe`: SWE-bench / SWE-Gym instances; `tasks harbor`: Harbor task "
    "folders; `tasks generate`: small generated families with a held-out split) and check them (`tasks check`).",
    no_args_is_help=True,
)


@tasks_app.command("generate")
def generate_command(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Directory: train.jsonl, held_out.jsonl, workspace/.")
    ],
    family: Annotated[
        str,
        typer.Option(
            help="Comma list of families: add (answer a sum); write, append, rename, fix (create, extend, rename or "
            "correct a file)."
        ),
    ] = "add",
    train: Annotated[int, typer.Option(help="Training tasks per family.")] = 16,
    held_out: Annotated[int, typer.Option(help="Held-out tasks per family (never trained on).")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the split and the order.")] = 0,
) -> None:
    """Generated tasks (polar_mitm/tasks/generated.py): disjoint training and held-out item pools."""
    from polar_mitm.tasks.generated import generate, write_split

    try:
        split = generate([f.strip() for f in family.split(",") if f.strip()], train, held_out, seed)
    except ValueError as exc:
        typer.echo(f"polar-mitm tasks generate: {exc}", err=True)
        raise typer.Exit(2) from exc
    train_file, held_out_file = write_split(split, out)
    typer.echo(
        f"{len(split.train)} training tasks → {train_file}; {len(split.held_out)} held out → {held_out_file}"
    )


@tasks_app.command("swe")
def swe_command(
    instances: Annotated[
        Path, typer.Argument(help="Instance file: SWE-bench format, .jsonl, .json or .parquet.")
    ],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Task file to write (JSONL); specs go to OUT.swe/.")
    ],
    repos: Annotated[
        Path | None,
        typer.Option(
            help="Mirror directory: OWNER__NAME, OWNER/NAME or NAME (+ .git/.bundle) per repository."
        ),
    ] = None,
    git_url: Annotated[
        str, typer.Option(help="Clone URL when there is no mirror ({repo} = OWNER/NAME).")
    ] = "https://github.com/{repo}.git",
    prompt_template: Annotated[
        Path | None,
        typer.Option(
            help="Prompt template file, str.format: {problem_statement} {repo} {instance_id} {base_commit} "
            "{hints_text} {version}."
        ),
    ] = None,
    test_command: Annotated[
        str, typer.Option(help="Test command; the test files of test_patch are appended.")
    ] = "python -m pytest -rA --tb=no -p no:cacheprovider",
    log_parser: Annotated[
        str, typer.Option(help="swebench log parser for the test output.")
    ] = "parse_log_pytest",
    reward: Annotated[
        str,
        typer.Option(
            help="resolved: 1.0 when all FAIL_TO_PASS and PASS_TO_PASS pass | fraction: share of FAIL_TO_PASS "
            "fixed, 0.0 if a PASS_TO_PASS test fails."
        ),
    ] = "resolved",
    image: Annotated[
        str | None,
        typer.Option(
            help="Run the tests in this image per instance, e.g. swebench/sweb.eval.x86_64.{docker_id}:latest "
            "({instance_id} {docker_id} {repo} {org} {name} {version})."
        ),
    ] = None,
    container: Annotated[str, typer.Option(help="docker | apptainer (with --image).")] = "docker",
    requirements: Annotated[
        list[str] | None,
        typer.Option("--requirement", help="Package for each task's venv (repeat; default: this pytest)."),
    ] = None,
    env_root: Annotated[
        Path | None, typer.Option(help="Where per-task venvs go (default OUT.swe/envs).")
    ] = None,
    keep_history: Annotated[
        bool, typer.Option(help="Keep the clone's other refs and later commits (they may hold the fix).")
    ] = False,
    run_timeout: Annotated[float, typer.Option(help="Seconds for the agent.")] = 1800,
    eval_timeout: Annotated[float, typer.Option(help="Seconds for grading.")] = 900,
    init_timeout: Annotated[
        float, typer.Option(help="Seconds for clone, checkout and the environment.")
    ] = 600,
) -> None:
    """Turn SWE-bench / SWE-Gym instances into a rollout task file (repo at base_commit, graded by its tests)."""
    options = SweOptions(
        repos=repos,
        git_url=git_url,
        test_command=test_command,
        log_parser=log_parser,
        reward=reward,
        image=image,
        container=container,
        env_root=env_root,
        keep_history=keep_history,
        timeouts={"init": init_timeout, "run": run_timeout, "eval": eval_timeout},
    )
    if requirements:
        options.requirements = requirements
    options.prompt_template = (
        prompt_template.read_text(encoding="utf-8") if prompt_template else DEFAULT_PROMPT
    )
    try:
        tasks = write_tasks(load_instances(instances), options, out)
        load_tasks(out)  # what `rollout` will read: checked now, not at the first session
    except (InstanceError, TaskFileError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{len(tasks)} tasks → {out} (grading specs in {out.with_name(out.stem + '.swe')})")


@tasks_app.command("harbor")
def harbor_command(
    folders: Annotated[
        list[Path],
        typer.Argument(help="Harbor task folders, or folders of them (task.toml, instruction.md…)."),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="Task file to write (JSONL); workspaces and tests go to OUT.harbor/."
        ),
    ],
    skip_run: Annotated[
        bool,
        typer.Option(
            help="Convert tasks whose Dockerfile has RUN lines, skipping them (each with a warning): sessions run "
            "on this machine's system; `tasks check` shows whether it has what the task needs."
        ),
    ] = False,
    reward_rule: Annotated[
        str,
        typer.Option(
            help="How reward.json's named numbers become one reward: only (exactly one, else refused) | mean | "
            "min | max | sum | key:NAME. A task.toml's metadata.reward_rule overrides it."
        ),
    ] = "only",
) -> None:
    """Turn Harbor / Terminal-Bench 2 task folders (and Terminal-Bench 1 task.yaml ones) into a rollout task file,
    graded by each task's tests/test.sh (recipes/harbor.md)."""
    from polar_mitm.tasks.harbor import ConvertOptions, HarborTaskError, convert

    try:
        lines, warnings = convert(folders, out, ConvertOptions(skip_run=skip_run, reward_rule=reward_rule))
        load_tasks(out)  # what `rollout` will read: checked now, not at the first session
    except HarborTaskError as exc:
        for problem in str(exc).splitlines():
            typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(2) from None
    except TaskFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for warning in warnings:
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"{len(lines)} tasks → {out} (workspaces and tests in {out.with_name(out.stem + '.harbor')})")


@tasks_app.command("check")
def check_command(
    tasks_file: Annotated[Path, typer.Argument(help="Task file (JSONL) with Harbor tasks (eval.harbor).")],
    parallel: Annotated[int, typer.Option(help="Tasks checked at a time.")] = 2,
    sandbox: Annotated[
        str,
        typer.Option(
            help="bwrap | podman | docker: the sandbox each oracle and verifier runs in, a rollout session's "
            "(recipes/sandboxes.md)."
        ),
    ] = DEFAULT_SANDBOX,
    image: Annotated[str | None, typer.Option(help="The container image of --sandbox podman|docker.")] = None,
) -> None:
    """Run each Harbor task's oracle (solution/solve.sh: must score 1.0) and a no-op agent (must score 0.0), each in
    the sandbox a rollout session of the task gets."""
    import asyncio

    from polar_mitm.tasks.harbor_check import check_sandbox, check_tasks, table

    confined = check_sandbox(sandbox, image)  # one that cannot run here: one line and exit 2, before any task
    try:
        tasks = load_tasks(tasks_file)
    except TaskFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    harbor_tasks = [task for task in tasks if task.harbor is not None]
    if not harbor_tasks:
        typer.echo(f"error: {tasks_file}: no Harbor tasks (eval.harbor) to check", err=True)
        raise typer.Exit(2)
    if skipped := len(tasks) - len(harbor_tasks):
        typer.echo(f"note: {skipped} tasks without eval.harbor are not checked", err=True)
    results = asyncio.run(check_tasks(confined, harbor_tasks, parallel))
    typer.echo(table(results))
    failing = [result.task_id for result in results if result.problems]
    if failing:
        typer.echo(f"{len(failing)} of {len(results)} tasks fail: {', '.join(failing)}", err=True)
        raise typer.Exit(1)
    typer.echo(f"all {len(results)} tasks pass their oracle and fail their no-op")
