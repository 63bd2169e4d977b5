"""The task file's schema (issue 38): a misspelt, missing or unknown field is one line naming the file, the line and
the field, and `rollout` / `loop` exit 2 before anything starts. Before it, a misspelt `eval` loaded without a word
and the check defaulted to `true`: every session scored 1.0 and nothing trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.tasks.task_file import TaskFileError, load_tasks

GOOD = {"task_id": "t", "prompt": "Create out.txt", "eval": "test -f out.txt"}

MISTAKES = [
    ({"evaluation": {"command": "true"}}, "unknown field 'evaluation': did you mean 'eval'?"),
    ({"eval": None}, "eval"),
    ({"timeout": {"run": 5}}, "unknown field 'timeout': did you mean 'timeouts'?"),
    ({"workspace": {"directory": "ws"}}, "unknown field 'workspace.directory': did you mean 'dir'?"),
    ({"eval": {"cmd": "true"}}, "unknown field 'eval.cmd'"),
    ({"eval": {"command": "true", "reward": "max"}}, "eval.reward"),
    ({"answer": 4}, 'put your own data under "meta"'),
    ({"workspace": {"dir": "no-such-folder"}}, "workspace.dir 'no-such-folder' is not a folder"),
    ({"timeouts": {"run": "10"}}, "timeouts.run"),
    ({"workspace": {"setup": ["git init", ""]}}, "workspace.setup[1]"),
]


def write(folder: Path, *rows: dict) -> Path:
    path = folder / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("change,named", MISTAKES, ids=[m[1][:40] for m in MISTAKES])
def test_a_mistake_is_refused_with_its_file_line_and_field(tmp_path, change, named):
    row = {**GOOD, **change}
    row = {k: v for k, v in row.items() if v is not None}
    path = write(tmp_path, {**GOOD, "task_id": "first"}, row)
    with pytest.raises(TaskFileError) as caught:
        load_tasks(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:2: ") and named in message and "\n" not in message, message


def test_a_task_without_a_check_says_how_to_reward_on_purpose(tmp_path):
    path = write(tmp_path, {"task_id": "t", "prompt": "p"})
    with pytest.raises(TaskFileError, match='eval is missing: every task needs a check.*"eval": "true"'):
        load_tasks(path)


def test_every_field_the_schema_knows_loads(tmp_path):
    (tmp_path / "ws").mkdir()
    row = {
        **GOOD,
        "eval": {"command": "python check.py", "reward": "stdout"},
        "workspace": {"dir": "ws", "setup": "git init -q"},
        "timeouts": {"init": 5, "run": 60.5, "eval": 5},
        "family": "add",
        "meta": {"source": "hand-written"},
    }
    [task] = load_tasks(write(tmp_path, row))
    assert task.workspace_dir == (tmp_path / "ws").resolve() and task.setup == ["git init -q"]
    assert (task.eval_command, task.eval_reward, task.timeouts.run) == ("python check.py", "stdout", 60.5)
    assert task.meta == {"family": "add", "meta": {"source": "hand-written"}}


@pytest.mark.parametrize("command,out", [("rollout", "--out"), ("loop", "-o")])
def test_rollout_and_loop_refuse_a_misspelt_check_in_one_line_with_exit_2(tmp_path, command, out):
    path = write(tmp_path, {"task_id": "t", "prompt": "p", "evaluation": "true"})
    result = CliRunner().invoke(app, [command, str(path), out, str(tmp_path / "out")], catch_exceptions=False)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"{path}:1: unknown field 'evaluation': did you mean 'eval'?" in lines[0]
    assert not (tmp_path / "out").exists()  # nothing started
