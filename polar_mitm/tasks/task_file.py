"""The task file (JSONL): one task per line, each a prompt, a workspace, an evaluation and timeouts.

    {"task_id": "hello-file",
     "prompt": "Create out.txt containing the word hello.",
     "workspace": {"dir": "tasks/hello", "setup": ["git init -q"]},      # dir is copied per session
     "eval": {"command": "grep -q hello out.txt", "reward": "exit"},      # exit: 1.0 if exit 0 else 0.0
     "timeouts": {"init": 60, "run": 300, "eval": 60}}                     # seconds

`eval.reward` = "exit" (default) or "stdout" (the last number printed is the reward). A session *passes* (pass rates,
pass@k) when its reward reaches full marks, 1.0 (`passed`): a graded check's partial credit is reward, not a pass.
The evaluation runs in the session's workspace with `$POLAR_HARNESS_OUTPUT` naming the harness's output (its log),
for checks that grade the agent's final answer (`python -P -m polar_mitm.tasks.answer_check`). A relative `workspace.dir`
is resolved against the task file's folder; `workspace.git` clones a repository (local path, scp-like address, or a
file/http(s)/ssh/git URL; transport helpers such as `ext::` are refused) instead — git gets it as one argument,
never through a shell.

Task ids: any text except empty, '/', '.', '..', control or separator characters (NUL, ESC, newlines, DEL, U+2028…)
and more than 200 bytes — see `polar_mitm.harness.base.id_problem`. Shell syntax in an id is harmless: every place an
id reaches a shell quotes it. A bad line is rejected at load with its line number, before anything runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.harness.base import id_problem

GIT_URL_SCHEMES = (
    "file",
    "http",
    "https",
    "ssh",
    "git",
    "git+ssh",
    "ssh+git",
)  # transports git itself speaks
GIT_HELPER = re.compile(
    r"([A-Za-z0-9+.-]*)::"
)  # git's own test (transport.c): NAME:: selects a remote helper
GIT_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


FULL_MARKS = 1.0


def passed(reward: float) -> bool:
    """Whether a session's reward is a pass: full marks (an exit-code check's 1.0, a graded check's top grade)."""
    return reward >= FULL_MARKS


class TaskFileError(ValueError):
    """A task file line that cannot be used (with its line number)."""


@dataclass
class Timeouts:
    init: float = 120.0
    run: float = 600.0
    eval: float = 120.0


@dataclass
class Task:
    task_id: str
    prompt: str
    workspace_dir: Path | None = None
    workspace_git: str | None = None
    setup: list[str] = field(default_factory=list)
    eval_command: str = "true"
    eval_reward: str = "exit"  # exit | stdout
    timeouts: Timeouts = field(default_factory=Timeouts)
    meta: dict[str, Any] = field(default_factory=dict)


def parse_task(raw: dict[str, Any], base: Path) -> Task:
    """One task from its JSON object; a ValueError names the field at fault."""
    if not isinstance(raw, dict):
        raise ValueError("a task must be a JSON object")
    task_id = raw.get("task_id")
    if (problem := id_problem(task_id)) is not None:
        raise ValueError(f"task_id {problem}: {task_id!r}")
    prompt = _text(raw.get("prompt"), "prompt")
    ws = _object(raw.get("workspace"), "workspace")
    ev = raw.get("eval") or {}
    if isinstance(ev, str):
        ev = {"command": ev}
    ev = _object(ev, "eval")
    reward_mode = ev.get("reward", "exit")
    if reward_mode not in ("exit", "stdout"):
        raise ValueError("eval.reward must be 'exit' or 'stdout'")
    t = _object(raw.get("timeouts"), "timeouts")
    ws_dir = _text(ws["dir"], "workspace.dir") if ws.get("dir") is not None else None
    return Task(
        task_id=task_id,
        prompt=prompt,
        workspace_dir=(base / ws_dir).resolve() if ws_dir else None,
        workspace_git=_git_source(ws.get("git")),
        setup=_commands(ws.get("setup"), "workspace.setup"),
        eval_command=_text(ev.get("command", "true"), "eval.command"),
        eval_reward=reward_mode,
        timeouts=Timeouts(
            init=_seconds(t, "init", 120), run=_seconds(t, "run", 600), eval=_seconds(t, "eval", 120)
        ),
        meta={
            k: v for k, v in raw.items() if k not in ("task_id", "prompt", "workspace", "eval", "timeouts")
        },
    )


def _text(value: Any, name: str) -> str:
    """A non-empty string without NUL (argv, environments and paths cannot carry one)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    if "\0" in value:
        raise ValueError(f"{name} cannot contain a NUL character")
    return value


def _object(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object")
    return value


def _commands(value: Any, name: str) -> list[str]:
    """Shell commands: one string or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a string or a list of strings")
    return [_text(command, f"{name}[{i}]") for i, command in enumerate(value)]


def _git_source(value: Any) -> str | None:
    """A repository to clone; passed to git as one argument after `--`, so it cannot become an option.

    Only plain transports are accepted: a local path, scp-like `user@host:path`, or a URL whose scheme git handles
    itself (GIT_URL_SCHEMES). git reads `NAME::ADDRESS` (and a URL of any other scheme) as "run the remote helper
    git-remote-NAME": `ext::CMD` runs a command, `fd::3` talks over a file descriptor and waits forever.
    """
    if value is None:
        return None
    source = _text(value, "workspace.git")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in source):
        raise ValueError(f"workspace.git cannot contain control characters: {source!r}")
    if (helper := GIT_HELPER.match(source)) is not None:
        raise ValueError(
            f"workspace.git {source!r} names the git transport helper {helper.group(1)!r}::; "
            f"use a local path, scp-like user@host:path or a {'/'.join(GIT_URL_SCHEMES)} URL"
        )
    scheme = GIT_URL.match(source)
    if scheme is not None and scheme.group(1).lower() not in GIT_URL_SCHEMES:
        raise ValueError(
            f"workspace.git {source!r}: git would hand the scheme {scheme.group(1)!r} to a remote "
            f"helper; use a local path, scp-like user@host:path or a {'/'.join(GIT_URL_SCHEMES)} URL"
        )
    return source


def _seconds(timeouts: dict[str, Any], key: str, default: float) -> float:
    value = timeouts.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ValueError(f"timeouts.{key} must be a positive number of seconds, got {value!r}")
    return float(value)


def load_tasks(path: str | Path) -> list[Task]:
    """Parse a JSONL task file; every error is a TaskFileError naming the file and line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TaskFileError(f"{path}: {exc.strerror or exc}") from exc
    tasks: list[Task] = []
    seen: set[str] = set()
    # Split bytes at \n only: str.splitlines would also split at U+2028 and friends, valid inside JSON strings.
    for lineno, raw_line in enumerate(data.split(b"\n"), 1):
        try:
            line = raw_line.decode("utf-8")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            task = parse_task(json.loads(line), path.parent)
        except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise TaskFileError(f"{path}:{lineno}: {exc}") from exc
        if task.task_id in seen:
            raise TaskFileError(f"{path}:{lineno}: duplicate task_id {task.task_id!r}")
        seen.add(task.task_id)
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: no tasks")
    return tasks
