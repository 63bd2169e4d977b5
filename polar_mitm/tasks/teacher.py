"""The teacher of generated tasks: a scripted policy that solves each one through any harness's own shell tool.

Why: a small model that never calls a tool gives GRPO nothing to learn from on file tasks (base SmolLM2 made 0 of 24
parsed tool calls on Pi's prompt). The standard remedy is a short supervised warm start on successful trajectories.
This teacher makes them through the very pipeline RL uses: the engine plays the script below (its tokens are the
student's tokenizer's, so the records are the student's own token ids), the real harness runs the call, the gateway
records it, the task's check grades it, and `polar-mitm sft` exports what passed (benchmarks/warm_start.py).

For each task the script holds two replies keyed by the task's prompt (the engine's `replies`, polar_mitm/engine/
script.py): turn 0 runs the one shell command that solves it with the harness's shell tool (`shell_call`: whichever
shell tool the request offers), turn 1 ends with FINAL. An `add` task is answered at turn 0 with the number alone.
"""

from __future__ import annotations

import shlex
from typing import Any

from polar_mitm.harness.policy import CLAUDE_COMPACT, GEMINI_ROUTER, SIDE_TEXT, shell_call
from polar_mitm.tasks.generated import prompt_items

FINAL = "Done."


def solution_command(task: dict[str, Any]) -> str | None:
    """The shell command that solves a generated file task (None for `add`, answered in words)."""
    family, items = task.get("family"), prompt_items(task["prompt"])
    quoted = [shlex.quote(item) for item in items]
    if family == "write":
        name, word = quoted
        return f"echo {word} > {name}"
    if family == "append":
        word, name = quoted
        return f"echo {word} >> {name}"
    if family == "rename":
        old, new = quoted
        return f"mv {old} {new}"
    if family == "fix":
        name, wrong, right = items
        return f"sed -i {shlex.quote(f's/{wrong}/{right}/')} {shlex.quote(name)}"
    if family == "add":
        return None
    raise ValueError(
        f"task {task.get('task_id')!r}: the teacher knows the generated families only, not {family!r}"
    )


def teacher_replies(task: dict[str, Any]) -> list[dict[str, Any]]:
    command = solution_command(task)
    if command is None:  # add: the number alone, the answer the check gives full marks
        a, b = map(int, prompt_items(task["prompt"]))
        return [{"when": task["prompt"], "turn": 0, "text": str(a + b)}]
    return [
        {
            "when": task["prompt"],
            "turn": 0,
            "text": f"Running `{command}`.",
            "tool_call": shell_call(command),
        },
        {"when": task["prompt"], "turn": 1, "text": FINAL},
    ]


def teacher_script(tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine script (`--script`) that solves every task in `tasks` through any harness with a shell tool."""
    replies = [reply for task in tasks for reply in teacher_replies(task)]
    return {"turns": [FINAL], "side": SIDE_TEXT, "replies": [GEMINI_ROUTER, CLAUDE_COMPACT, *replies]}
