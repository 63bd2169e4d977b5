"""Harbor task folders as rollout tasks (`polar-mitm tasks harbor DIR… -o tasks.jsonl`); Terminal-Bench 1 folders
(`task.yaml`) are staged into Harbor's layout first (tasks/terminal_bench.py).

Harbor's layout (Terminal-Bench 2.0; read from Harbor's `models/task/config.py` and its docs):

    task-name/
      task.toml         [task] name…, [metadata] (free-form), [verifier] timeout_sec/env/user, [agent] timeout_sec/user,
                        [environment] build_timeout_sec, docker_image, cpus, memory_mb, storage_mb, gpus…, [solution] env
      instruction.md    the prompt
      environment/      Dockerfile (or docker-compose.yaml with the service `main`): the image the task runs in
      tests/test.sh     the verifier: writes /logs/verifier/reward.txt (a number) or reward.json (named numbers)
      solution/solve.sh the oracle (optional)

Sessions run on this machine's own system, not in the task's image: what an environment may do, and what is
refused, is polar_mitm/tasks/harbor_environment.py's rule.

Every bad folder is one error naming its file and field (`HarborTaskError`), and every folder is read before any
error is raised, so one run names them all. `[metadata] reward_rule = "mean"` overrides `--reward-rule` per task.
`[verifier].user` and `[agent].user` are read but cannot be applied (a sandbox has one user): each is a warning.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError

from polar_mitm.harness.base import id_problem
from polar_mitm.tasks.harbor_environment import Environment, HarborTaskError, read_environment
from polar_mitm.tasks.task_file import USER_NOT_APPLIED, check_reward_rule
from polar_mitm.tasks.terminal_bench import TaskYamlError, is_task_yaml_folder, stage

TASK_TOML = "task.toml"
INSTRUCTION = "instruction.md"
TEST_SCRIPT = "tests/test.sh"
SOLVE_SCRIPT = "solution/solve.sh"


# -- task.toml (Harbor's TaskConfig, strict: an unknown field is refused) -------------------------------------------


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class AuthorSection(_Section):
    name: StrictStr
    email: StrictStr | None = None


class TaskSection(_Section):
    name: StrictStr
    description: StrictStr = ""
    authors: list[AuthorSection] = []
    keywords: list[StrictStr] = []


class VerifierSection(_Section):
    timeout_sec: Seconds = 600.0
    env: dict[StrictStr, StrictStr] = {}
    user: StrictStr | int | None = None


class AgentSection(_Section):
    timeout_sec: Seconds | None = None
    user: StrictStr | int | None = None


class EnvironmentSection(_Section):
    build_timeout_sec: Seconds = 600.0
    docker_image: StrictStr | None = None
    cpus: int = 1
    memory_mb: int = 2048
    storage_mb: int = 10240
    gpus: int = 0
    gpu_types: list[StrictStr] | None = None
    allow_internet: bool = True
    mcp_servers: list[dict[str, Any]] = []
    env: dict[StrictStr, StrictStr] = {}
    skills_dir: StrictStr | None = None
    memory: StrictStr | None = None  # deprecated by Harbor for memory_mb
    storage: StrictStr | None = None  # deprecated by Harbor for storage_mb


class SolutionSection(_Section):
    env: dict[StrictStr, StrictStr] = {}


class TaskToml(_Section):
    version: StrictStr | None = None  # Harbor's older name of schema_version
    schema_version: StrictStr | None = None
    source: StrictStr | None = None
    task: TaskSection | None = None
    metadata: dict[str, Any] = {}
    verifier: VerifierSection = VerifierSection()
    agent: AgentSection = AgentSection()
    environment: EnvironmentSection = EnvironmentSection()
    solution: SolutionSection = SolutionSection()


def _toml_problem(exc: ValidationError) -> str:
    """The first problem as `[section].field: what`, an unknown field named with the section's known ones."""
    error = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    loc = [str(part) for part in error["loc"]]
    where = f"[{loc[0]}].{'.'.join(loc[1:])}" if len(loc) > 1 else loc[0] if loc else "task.toml"
    if error["type"] == "extra_forbidden":
        section = {
            "task": TaskSection,
            "verifier": VerifierSection,
            "agent": AgentSection,
            "environment": EnvironmentSection,
            "solution": SolutionSection,
        }.get(loc[0] if len(loc) > 1 else "", TaskToml)
        return f"unknown field {where}: the fields are {', '.join(section.model_fields)}"
    return f"{where}: {str(error['msg']).removeprefix('Value error, ')}"


# -- what one folder becomes --------------------------------------------------------------------------------------


@dataclass
class HarborTask:
    """One Harbor task folder, read and checked."""

    folder: Path
    task_id: str
    config: TaskToml
    instruction: str
    environment: Environment
    has_solution: bool
    source: Path | None = None  # the folder the user named, when this one was staged from it (task.yaml)
    memory_mb: int | None = None  # [environment].memory_mb (or the older memory = "2G") when the task sets it


def read_task(folder: Path, skip_run: bool = False) -> HarborTask:
    """Read one Harbor task folder; a HarborTaskError names the file and field at fault."""
    folder = folder.resolve()
    config = _read_toml(folder / TASK_TOML)
    instruction_path = folder / INSTRUCTION
    if not instruction_path.is_file():
        raise HarborTaskError(f"{instruction_path}: missing (Harbor's task prompt)")
    instruction = instruction_path.read_text(encoding="utf-8")
    if not instruction.strip():
        raise HarborTaskError(f"{instruction_path}: empty (Harbor's task prompt)")
    if not (folder / TEST_SCRIPT).is_file():
        raise HarborTaskError(f"{folder / TEST_SCRIPT}: missing (the verifier, which writes the reward)")
    if config.environment.mcp_servers:
        raise HarborTaskError(
            f"{folder / TASK_TOML}: [environment].mcp_servers: MCP servers are not started for sessions"
        )
    if "reward_rule" in config.metadata:
        try:
            check_reward_rule(config.metadata["reward_rule"])
        except (ValueError, TypeError) as exc:
            raise HarborTaskError(f"{folder / TASK_TOML}: [metadata].reward_rule: {exc}") from None
    if (problem := id_problem(folder.name)) is not None:
        raise HarborTaskError(f"{folder}: the folder name is the task id, and it {problem}")
    environment = read_environment(folder / "environment", config.environment.docker_image, skip_run)
    memory_mb = _memory_mb(config.environment, folder / TASK_TOML)
    return HarborTask(
        folder=folder,
        task_id=folder.name,
        config=config,
        instruction=instruction,
        environment=environment,
        has_solution=(folder / SOLVE_SCRIPT).is_file(),
        memory_mb=memory_mb,
    )


def _memory_mb(environment: EnvironmentSection, path: Path) -> int | None:
    """The memory the task's author gave its container, in MiB (the session's `limits.memory_mb`); None: unset."""
    if "memory_mb" in environment.model_fields_set:
        memory_mb = environment.memory_mb
    elif environment.memory is not None:
        size = environment.memory.strip().upper()
        scale = {"G": 1024, "M": 1, "K": 1 / 1024}.get(size[-1:])
        try:
            memory_mb = int(float(size[:-1]) * scale) if scale else -1
        except ValueError:
            memory_mb = -1
    else:
        return None
    if memory_mb <= 0:
        raise HarborTaskError(f'{path}: [environment].memory_mb: a positive number of MiB (or memory = "2G")')
    return memory_mb


def _read_toml(path: Path) -> TaskToml:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HarborTaskError(f"{path}: missing (Harbor's task configuration)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HarborTaskError(f"{path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise HarborTaskError(f"{path}: not TOML: {exc}") from None
    try:
        return TaskToml.model_validate(raw)
    except ValidationError as exc:
        raise HarborTaskError(f"{path}: {_toml_problem(exc)}") from None


# -- folders → task lines -----------------------------------------------------------------------------------------


def find_task_folders(paths: list[Path]) -> list[Path]:
    """Each path: a task folder (it holds task.toml or instruction.md) or a folder of them."""
    folders: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise HarborTaskError(f"{path}: not a folder")
        if _looks_like_task(path):
            folders.append(path)
            continue
        children = sorted(child for child in path.iterdir() if child.is_dir() and _looks_like_task(child))
        if not children:
            raise HarborTaskError(
                f"{path}: no Harbor task here (a folder with task.toml, or folders of them)"
            )
        folders.extend(children)
    return folders


def _looks_like_task(path: Path) -> bool:
    return any((path / name).exists() for name in (TASK_TOML, INSTRUCTION, "tests", "task.yaml"))


@dataclass
class ConvertOptions:
    """How Harbor folders become task lines (the `polar-mitm tasks harbor` options)."""

    skip_run: bool = False
    reward_rule: str = "only"


def task_line(task: HarborTask, store: Path, out_dir: Path, reward_rule: str) -> dict[str, Any]:
    """The task line of one Harbor task; its workspace, tests and solution are written under `store`."""
    target = store / task.task_id
    if target.exists():
        shutil.rmtree(target)
    workspace = target / "workspace"
    workspace.mkdir(parents=True)
    for source, destination in task.environment.copies:
        _place(source, workspace, destination)
    shutil.copytree(task.folder / "tests", target / "tests", symlinks=True)
    if task.has_solution:
        shutil.copytree(task.folder / "solution", target / "solution", symlinks=True)
    config = task.config
    rule = config.metadata.get("reward_rule", reward_rule)
    harbor: dict[str, Any] = {
        "tests": _relative(target / "tests", out_dir),
        "workdir": task.environment.workdir,
        "env": {**task.environment.env, **config.verifier.env},
        "reward_rule": rule,
    }
    if task.has_solution:
        harbor["solution"] = _relative(target / "solution", out_dir)
    timeouts = {"init": config.environment.build_timeout_sec, "eval": config.verifier.timeout_sec}
    if config.agent.timeout_sec is not None:
        timeouts["run"] = config.agent.timeout_sec
    meta: dict[str, Any] = {
        "source": str(task.source or task.folder),
        "name": config.task.name if config.task else None,
        "metadata": config.metadata,
        "image": task.environment.image,
        "environment": config.environment.model_dump(exclude={"mcp_servers", "memory", "storage"}),
        "solution_env": config.solution.env,
    }
    if task.environment.skipped:
        meta["skipped"] = task.environment.skipped
    if task.environment.warnings:
        meta["warnings"] = task.environment.warnings
    return {
        "task_id": task.task_id,
        "prompt": task.instruction,
        "workspace": {"dir": _relative(workspace, out_dir)},
        "eval": {"harbor": harbor},
        "timeouts": timeouts,
        **({"limits": {"memory_mb": task.memory_mb}} if task.memory_mb is not None else {}),
        "meta": {"harbor": meta},
    }


def _place(source: Path, workspace: Path, destination: str) -> None:
    """Docker's COPY: a folder's contents into the destination; a file to it (or into it, if it ends in '/')."""
    target = workspace / destination if destination else workspace
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        return
    if destination.endswith("/") or not destination or target.is_dir():
        target = target / source.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


def convert(paths: list[Path], out: Path, options: ConvertOptions) -> tuple[list[dict[str, Any]], list[str]]:
    """Write the task file `out` (and its folders in OUT.harbor/) from Harbor task folders.

    Returns the lines and the warnings; raises HarborTaskError with one line per bad folder (all of them).
    """
    try:
        check_reward_rule(options.reward_rule)
    except ValueError as exc:
        raise HarborTaskError(f"--reward-rule: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="polar-harbor-") as scratch:
        tasks, problems = _read_all(find_task_folders(paths), options, Path(scratch))
        return _write(tasks, problems, out, options)


def _read_all(
    folders: list[Path], options: ConvertOptions, scratch: Path
) -> tuple[list[HarborTask], list[str]]:
    """Every folder read (a Terminal-Bench 1 one staged as a Harbor folder first); the problems, one per folder."""
    tasks: list[HarborTask] = []
    problems: list[str] = []
    for folder in folders:
        try:
            if is_task_yaml_folder(folder):
                staged = scratch / str(len(tasks) + len(problems)) / folder.name
                try:
                    warnings = stage(folder, staged)
                    task = read_task(staged, options.skip_run)
                except HarborTaskError as exc:  # name the task's own files, not the staged copies
                    message = str(exc).replace(str(staged.resolve() / "environment"), str(folder.resolve()))
                    raise HarborTaskError(message) from None
                task.source = folder.resolve()
                task.environment.warnings += warnings
            else:
                task = read_task(folder, options.skip_run)
            tasks.append(task)
        except (HarborTaskError, TaskYamlError) as exc:
            problems.append(str(exc))
    return tasks, problems


def _write(
    tasks: list[HarborTask], problems: list[str], out: Path, options: ConvertOptions
) -> tuple[list[dict[str, Any]], list[str]]:
    seen: dict[str, Path] = {}
    for task in tasks:
        if task.task_id in seen:
            problems.append(
                f"{task.source or task.folder}: the task id {task.task_id!r} is also {seen[task.task_id]}'s"
            )
        seen[task.task_id] = task.source or task.folder
    if problems:
        raise HarborTaskError("\n".join(problems))
    out_dir = out.resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    store = out_dir / f"{out.stem}.harbor"
    lines = [task_line(task, store, out_dir, options.reward_rule) for task in tasks]
    out.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    warnings = [f"{task.task_id}: {w}" for task in tasks for w in task.environment.warnings]
    warnings += [f"{task.task_id}: skipped {s}" for task in tasks for s in task.environment.skipped]
    warnings += [
        f"{task.task_id}: no solution/solve.sh (no oracle)" for task in tasks if not task.has_solution
    ]
    warnings += [
        f"{task.task_id}: task.toml [{section}].user = {user!r} {USER_NOT_APPLIED}"
        for task in tasks
        for section, user in (("verifier", task.config.verifier.user), ("agent", task.config.agent.user))
        if user is not None
    ]
    return lines, warnings
