"""Harbor task folders as rollout tasks (`polar-mitm tasks harbor DIR… -o tasks.jsonl`).

Harbor's layout (Terminal-Bench 2.0; read from Harbor's `models/task/config.py` and its docs):

    task-name/
      task.toml         [task] name…, [metadata] (free-form), [verifier] timeout_sec/env/user, [agent] timeout_sec,
                        [environment] build_timeout_sec, docker_image, cpus, memory_mb, storage_mb, gpus…, [solution] env
      instruction.md    the prompt
      environment/      Dockerfile (or docker-compose.yaml with the service `main`): the image the task runs in
      tests/test.sh     the verifier: writes /logs/verifier/reward.txt (a number) or reward.json (named numbers)
      solution/solve.sh the oracle (optional)

We run sessions on this machine's own system, not in the task's image, so the environment is read for what it puts
in the working directory and nothing else:

- `WORKDIR` (last one; default /app) is where the session's workspace is mounted (`eval.harbor.workdir`).
- `COPY`/`ADD` of files from the build context into the workdir become the workspace (written to OUT.harbor/TASK/).
  One that copies anywhere else, from another stage (`--from`) or a URL is refused: the task would not be what its
  author built.
- `RUN` is refused: on the host it would install packages or change the machine, and skipping it silently would
  make a task that its tests cannot pass. `--skip-run` converts such tasks anyway, skipping each RUN with a warning
  (recorded under meta.harbor.skipped); `polar-mitm tasks check` then shows whether this machine already has what
  the task needs (its oracle must still score 1.0).
- `ENV` variables go to the verifier's environment (the agent's environment is the harness's); `FROM`, `USER`,
  `ARG`, `EXPOSE`, `LABEL`, `CMD`, `ENTRYPOINT` and the like change nothing in the workdir and are ignored. A
  second `FROM` (a multi-stage build) and `$VARIABLES` in COPY/WORKDIR are refused.
- A compose file may hold only the service `main`; its `build` (context, dockerfile), `working_dir` and
  `environment` are read, its other keys ignored with a warning.

Every bad folder is one error naming its file and field (`HarborTaskError`), and every folder is read before any
error is raised, so one run names them all. `[metadata] reward_rule = "mean"` overrides `--reward-rule` per task.
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError

from polar_mitm.harness.base import id_problem

TASK_TOML = "task.toml"
INSTRUCTION = "instruction.md"
TEST_SCRIPT = "tests/test.sh"
SOLVE_SCRIPT = "solution/solve.sh"
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
DEFAULT_WORKDIR = "/app"
IGNORED_INSTRUCTIONS = {
    "FROM",
    "USER",
    "ARG",
    "EXPOSE",
    "LABEL",
    "MAINTAINER",
    "CMD",
    "ENTRYPOINT",
    "HEALTHCHECK",
    "STOPSIGNAL",
    "VOLUME",
    "SHELL",
    "ONBUILD",
}
COMPOSE_READ = {"build", "working_dir", "environment", "image"}


class HarborTaskError(ValueError):
    """A Harbor task folder that cannot become a task (the message names the file and field)."""


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
class Environment:
    """What a task's environment puts in the workdir, as far as we can honour it on the host."""

    workdir: str = DEFAULT_WORKDIR
    image: str | None = None
    copies: list[tuple[Path, str]] = field(
        default_factory=list
    )  # (source in the context, destination in workdir)
    env: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # RUN lines skipped with --skip-run
    warnings: list[str] = field(default_factory=list)


@dataclass
class HarborTask:
    """One Harbor task folder, read and checked."""

    folder: Path
    task_id: str
    config: TaskToml
    instruction: str
    environment: Environment
    has_solution: bool


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
    if (problem := id_problem(folder.name)) is not None:
        raise HarborTaskError(f"{folder}: the folder name is the task id, and it {problem}")
    environment = read_environment(folder / "environment", config, skip_run)
    return HarborTask(
        folder=folder,
        task_id=folder.name,
        config=config,
        instruction=instruction,
        environment=environment,
        has_solution=(folder / SOLVE_SCRIPT).is_file(),
    )


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


# -- environment/: a Dockerfile or a compose file -----------------------------------------------------------------


def read_environment(env_dir: Path, config: TaskToml, skip_run: bool) -> Environment:
    """The workdir, files and variables a task's environment sets up (see the module docstring for the rule)."""
    compose = next((env_dir / name for name in COMPOSE_FILES if (env_dir / name).is_file()), None)
    context, dockerfile = env_dir, env_dir / "Dockerfile"
    environment = Environment(image=config.environment.docker_image)
    if compose is not None:
        context, dockerfile = _read_compose(compose, env_dir, environment)
    if dockerfile is not None and dockerfile.is_file():
        _read_dockerfile(dockerfile, context, environment, skip_run)
    elif config.environment.docker_image is None and environment.image is None:
        raise HarborTaskError(
            f"{dockerfile or env_dir / 'Dockerfile'}: missing (or set [environment].docker_image in task.toml)"
        )
    return environment


def _read_compose(path: Path, env_dir: Path, environment: Environment) -> tuple[Path, Path | None]:
    try:
        compose = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise HarborTaskError(f"{path}: not YAML: {one_line(exc)}") from None
    services = compose.get("services") if isinstance(compose, dict) else None
    if not isinstance(services, dict) or not isinstance(services.get("main"), dict):
        raise HarborTaskError(f"{path}: services.main: missing (Harbor runs the agent in the service `main`)")
    if others := sorted(set(services) - {"main"}):
        raise HarborTaskError(
            f"{path}: services.{others[0]}: only the service `main` can run (sessions get no side services)"
        )
    main = services["main"]
    for key in sorted(set(main) - COMPOSE_READ):
        environment.warnings.append(f"{path.name}: services.main.{key} ignored")
    if isinstance(main.get("image"), str):
        environment.image = main["image"]
    if "working_dir" in main:
        environment.workdir = _workdir(str(main["working_dir"]), environment.workdir, f"{path}: working_dir")
    environment.env.update(_compose_env(main.get("environment"), path))
    build = main.get("build")
    if build is None:
        return env_dir, None
    context_name, dockerfile_name = (build, "Dockerfile") if isinstance(build, str) else (None, None)
    if isinstance(build, dict):
        context_name, dockerfile_name = build.get("context", "."), build.get("dockerfile", "Dockerfile")
    if not isinstance(context_name, str) or not isinstance(dockerfile_name, str):
        raise HarborTaskError(f"{path}: services.main.build: a context folder (and dockerfile) expected")
    context_name = context_name.replace("${CONTEXT_DIR}", ".")  # what Harbor's own compose files write
    context = (env_dir / context_name).resolve()
    if not context.is_relative_to(env_dir.resolve()):
        raise HarborTaskError(
            f"{path}: services.main.build.context: {context_name!r} is outside environment/"
        )
    return context, context / dockerfile_name


def _compose_env(value: Any, path: Path) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return dict(item.partition("=")[::2] for item in value)
    raise HarborTaskError(f"{path}: services.main.environment: a mapping or a list of NAME=VALUE expected")


def _dockerfile_lines(path: Path) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments), continuation lines joined and comments dropped."""
    instructions: list[tuple[int, str, str]] = []
    pending, start = "", 0
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        start = start or lineno
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text, pending = pending + stripped, ""
        keyword, _, arguments = text.partition(" ")
        instructions.append((start, keyword.upper(), arguments.strip()))
        start = 0
    if pending:
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((start, keyword.upper(), arguments.strip()))
    return instructions


def _read_dockerfile(path: Path, context: Path, environment: Environment, skip_run: bool) -> None:
    stages = 0
    workdir = environment.workdir
    copies: list[tuple[int, str, str, str]] = []  # (line, source, destination, workdir then)
    for lineno, keyword, arguments in _dockerfile_lines(path):
        where = f"{path}:{lineno}: {keyword}"
        if keyword == "FROM":
            stages += 1
            if stages > 1:
                raise HarborTaskError(f"{where}: a multi-stage build cannot run on the host")
            environment.image = arguments.split()[0] if arguments else None
        elif keyword == "WORKDIR":
            workdir = _workdir(arguments, workdir, where)
        elif keyword in ("COPY", "ADD"):
            for source, destination in _copy_arguments(arguments, where):
                copies.append((lineno, source, destination, workdir))
        elif keyword == "RUN":
            if not skip_run:
                raise HarborTaskError(
                    f"{where}: {_short(arguments)!r} would change the host (sessions run on this machine's own "
                    "system, not the task's image); --skip-run converts the task without it"
                )
            environment.skipped.append(f"{path.name}:{lineno}: RUN {_short(arguments)}")
        elif keyword == "ENV":
            environment.env.update(_env_arguments(arguments, where))
        elif keyword not in IGNORED_INSTRUCTIONS:
            raise HarborTaskError(f"{where}: unknown Dockerfile instruction")
    environment.workdir = workdir
    for lineno, source, destination, workdir_then in copies:
        target = _inside_workdir(destination, workdir_then, workdir, f"{path}:{lineno}: COPY")
        for match in _sources(context, source, f"{path}:{lineno}: COPY"):
            environment.copies.append((match, target))


def _workdir(value: str, current: str, where: str) -> str:
    if "$" in value:
        raise HarborTaskError(f"{where}: {value!r}: variables are not expanded")
    path = PurePosixPath(current) / value.strip().strip('"')
    return str(PurePosixPath(*_normal_parts(path)))


def _normal_parts(path: PurePosixPath) -> list[str]:
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            if len(parts) > 1:
                parts.pop()
        elif part != ".":
            parts.append(part)
    return parts or ["/"]


def _copy_arguments(arguments: str, where: str) -> list[tuple[str, str]]:
    words = arguments.split()
    flags = [word for word in words if word.startswith("--")]
    for flag in flags:
        if not flag.startswith(("--chown", "--chmod", "--link")):
            raise HarborTaskError(f"{where}: {flag} is not supported (only files from the build context)")
    rest = arguments
    for flag in flags:
        rest = rest.replace(flag, "", 1)
    rest = rest.strip()
    paths = json.loads(rest) if rest.startswith("[") else rest.split()
    if len(paths) < 2 or not all(isinstance(p, str) for p in paths):
        raise HarborTaskError(f"{where}: SOURCE… DESTINATION expected")
    *sources, destination = paths
    for source in sources:
        if "$" in source or "$" in destination:
            raise HarborTaskError(f"{where}: {source!r}: variables are not expanded")
        if re.match(r"[a-z]+://", source):
            raise HarborTaskError(f"{where}: {source!r}: URLs are not fetched")
    if len(sources) > 1 and not destination.endswith("/"):
        destination += "/"
    return [(source, destination) for source in sources]


def _inside_workdir(destination: str, workdir_then: str, workdir: str, where: str) -> str:
    """The destination relative to the final workdir (trailing '/' kept: into that folder)."""
    absolute = PurePosixPath(*_normal_parts(PurePosixPath(workdir_then) / destination))
    if absolute != PurePosixPath(workdir) and not absolute.is_relative_to(workdir):
        raise HarborTaskError(
            f"{where}: {destination!r} lies outside the workdir {workdir} (only the workdir becomes the workspace)"
        )
    relative = str(absolute.relative_to(workdir))
    return "" if relative == "." else relative + ("/" if destination.endswith("/") else "")


def _sources(context: Path, source: str, where: str) -> list[Path]:
    matches = sorted(Path(p) for p in glob.glob(str(context / source)))
    if not matches:
        raise HarborTaskError(f"{where}: {source!r} is not in the build context {context}")
    for match in matches:
        if not match.resolve().is_relative_to(context.resolve()):
            raise HarborTaskError(f"{where}: {source!r} lies outside the build context {context}")
    return matches


def _env_arguments(arguments: str, where: str) -> dict[str, str]:
    try:
        words = shlex.split(arguments)
    except ValueError as exc:
        raise HarborTaskError(f"{where}: {exc}") from None
    if words and "=" not in words[0]:  # the old form: ENV NAME VALUE…
        return {words[0]: " ".join(words[1:])}
    return dict(word.partition("=")[::2] for word in words)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


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
    return any((path / name).exists() for name in (TASK_TOML, INSTRUCTION, "tests"))


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
    if config.verifier.user is not None:
        harbor["user"] = str(config.verifier.user)
    timeouts = {"init": config.environment.build_timeout_sec, "eval": config.verifier.timeout_sec}
    if config.agent.timeout_sec is not None:
        timeouts["run"] = config.agent.timeout_sec
    meta: dict[str, Any] = {
        "source": str(task.folder),
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
    tasks: list[HarborTask] = []
    problems: list[str] = []
    for folder in find_task_folders(paths):
        try:
            tasks.append(read_task(folder, options.skip_run))
        except HarborTaskError as exc:
            problems.append(str(exc))
    seen: dict[str, Path] = {}
    for task in tasks:
        if task.task_id in seen:
            problems.append(f"{task.folder}: the task id {task.task_id!r} is also {seen[task.task_id]}'s")
        seen[task.task_id] = task.folder
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
    return lines, warnings
