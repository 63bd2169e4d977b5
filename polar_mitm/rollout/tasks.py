"""The task file (JSONL): one task per line, each a prompt, a workspace, an evaluation and timeouts.

    {"task_id": "hello-file",
     "prompt": "Create out.txt containing the word hello.",
     "workspace": {"dir": "tasks/hello", "setup": ["git init -q"]},      # dir is copied per session
     "eval": {"command": "grep -q hello out.txt", "reward": "exit"},      # exit: 1.0 if exit 0 else 0.0
     "timeouts": {"init": 60, "run": 300, "eval": 60}}                     # seconds

`eval.reward` = "exit" (default) or "stdout" (the last number printed is the reward). A relative `workspace.dir`
is resolved against the task file's folder; `workspace.git` clones a repository (local path or URL) instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
    if not isinstance(raw, dict):
        raise TypeError("a task must be a JSON object")
    task_id, prompt = raw.get("task_id"), raw.get("prompt")
    if not isinstance(task_id, str) or not task_id or "/" in task_id:
        raise ValueError("task_id must be a non-empty string without '/'")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    ws = raw.get("workspace") or {}
    if not isinstance(ws, dict):
        raise TypeError("workspace must be an object")
    setup = ws.get("setup") or []
    if isinstance(setup, str):
        setup = [setup]
    ev = raw.get("eval") or {}
    if isinstance(ev, str):
        ev = {"command": ev}
    reward_mode = ev.get("reward", "exit")
    if reward_mode not in ("exit", "stdout"):
        raise ValueError("eval.reward must be 'exit' or 'stdout'")
    t = raw.get("timeouts") or {}
    ws_dir = ws.get("dir")
    return Task(
        task_id=task_id,
        prompt=prompt,
        workspace_dir=(base / ws_dir).resolve() if ws_dir else None,
        workspace_git=ws.get("git"),
        setup=[str(c) for c in setup],
        eval_command=str(ev.get("command", "true")),
        eval_reward=reward_mode,
        timeouts=Timeouts(init=float(t.get("init", 120)), run=float(t.get("run", 600)),
                          eval=float(t.get("eval", 120))),
        meta={k: v for k, v in raw.items() if k not in ("task_id", "prompt", "workspace", "eval", "timeouts")},
    )


def load_tasks(path: str | Path) -> list[Task]:
    """Parse a JSONL task file; errors name the line."""
    path = Path(path)
    tasks: list[Task] = []
    seen: set[str] = set()
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            task = parse_task(json.loads(line), path.parent)
        except (ValueError, TypeError) as exc:
            raise TaskFileError(f"{path}:{lineno}: {exc}") from exc
        if task.task_id in seen:
            raise TaskFileError(f"{path}:{lineno}: duplicate task_id {task.task_id!r}")
        seen.add(task.task_id)
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: no tasks")
    return tasks
