"""`polar-mitm tasks …`: task files made from other formats (`tasks swe`: SWE-bench / SWE-Gym instance files)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from polar_mitm.tasks.swe import DEFAULT_PROMPT, InstanceError, SweOptions, load_instances, write_tasks
from polar_mitm.tasks.task_file import TaskFileError, load_tasks

tasks_app = typer.Typer(
    help="Make rollout task files (`tasks swe`: SWE-bench / SWE-Gym instances; `tasks generate`: small generated "
    "families with a held-out split).",
    no_args_is_help=True,
)


@tasks_app.command("generate")
def generate_command(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Directory: train.jsonl, held_out.jsonl, workspace/.")
    ],
    family: Annotated[
        str, typer.Option(help="Comma list of families: add (answer a sum), write (create a file).")
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
