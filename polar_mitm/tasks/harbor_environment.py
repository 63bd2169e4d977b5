"""What a Harbor task's environment/ puts in the working directory, as far as we can honour it on the host.

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
"""

from __future__ import annotations

import glob
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

DEFAULT_WORKDIR = "/app"
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
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


# -- environment/: a Dockerfile or a compose file -----------------------------------------------------------------


def read_environment(env_dir: Path, docker_image: str | None, skip_run: bool) -> Environment:
    """The workdir, files and variables a task's environment sets up (see the module docstring for the rule);
    `docker_image` is task.toml's [environment].docker_image (an image instead of a Dockerfile)."""
    compose = next((env_dir / name for name in COMPOSE_FILES if (env_dir / name).is_file()), None)
    context, dockerfile = env_dir, env_dir / "Dockerfile"
    environment = Environment(image=docker_image)
    if compose is not None:
        context, dockerfile = _read_compose(compose, env_dir, environment)
    if dockerfile is not None and dockerfile.is_file():
        _read_dockerfile(dockerfile, context, environment, skip_run)
    elif docker_image is None and environment.image is None:
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
            pending += stripped[:-1].rstrip() + " "
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
