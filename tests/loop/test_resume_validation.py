"""`polar-mitm loop --resume` on a tampered run directory (issue 36 item 13): every file a resume reads is checked
before anything starts (loop/saved_state.py); a bad one is one line naming it (and the line of a JSON-lines file),
a non-zero exit, and no engine or gateway started. The run directory is written directly (the check needs no run),
as the loop writes it after iteration 0 trained. The command runs in this process (`polar_mitm.cli.app` under
Typer's CliRunner: the loop command's options import TRL, ~7 s a process), and once as its own process, where the
exit code and the one line are what a shell sees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.run_state import record_run
from polar_mitm.train.continuation import RunState

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
SESSION = {
    "task_id": "hello-file",
    "reward": 1.0,
    "status": "ok",
    "exit_code": 0,
    "init_seconds": 0.001,
    "run_seconds": 3.5,
    "eval_seconds": 0.01,
    "eval_output": "",
}
STATE = {
    "iteration": 0,
    "running": "push",
    "stages": {
        "rollout": {"time": 1.0, "seconds": 9.7, "sessions": 2, "kept_sessions": 0, "replaced_groups": 0},
        "merge": {
            "time": 2.0,
            "figures": {"sequences": 2, "trainable_records": 4, "trainable_tokens": 60, "total_tokens": 400},
            "seconds": 1.5,
        },
        "train": {"time": 3.0, "model_dir": "iter-0/train", "weight_version": "1", "seconds": 3.7},
    },
    "started": {"rollout": 0.5, "merge": 1.5, "train": 2.5, "push": 3.5},
}


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run of 2 iterations (the CPU demo tasks), killed in iteration 0's push."""
    run = tmp_path / "run"
    (run / "iter-0").mkdir(parents=True)
    record_run(run, LoopConfig(tasks=EXAMPLES / "tasks.jsonl", run_dir=run, group_size=2, model="tiny"))
    (run / "iter-0" / "state.json").write_text(json.dumps(STATE))
    sessions = [{**SESSION, "session_id": f"hello-file-{i}-ab", "sample_index": i} for i in range(2)]
    (run / "iter-0" / "sessions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sessions))
    (run / "trainer-state").mkdir()
    RunState(trainings=1, optimizer_steps=1, schedule_steps=1, policy_weight_version="1").save(
        run / "trainer-state"
    )
    (run / "loop.json").write_text("[]")
    return run


def edit_json(path: Path, change) -> None:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def cut(path: Path) -> None:
    path.write_text(path.read_text()[: len(path.read_text()) // 2])


def append(path: Path, line: str) -> None:
    with open(path, "a") as sink:
        sink.write(line + "\n")


# (name, what is done to the run directory, the file the one line must name)
TAMPERINGS = [
    ("cut run.json", lambda run: cut(run / "run.json"), "run.json"),
    (
        "garbage state.json",
        lambda run: (run / "iter-0/state.json").write_bytes(b"\x00\xffgarbage"),
        "iter-0/state.json",
    ),
    (
        "state.json without its train's model_dir",
        lambda run: edit_json(run / "iter-0/state.json", lambda s: s["stages"]["train"].pop("model_dir")),
        "iter-0/state.json",
    ),
    (
        "garbage run_state.json",
        lambda run: (run / "trainer-state/run_state.json").write_text("{not json"),
        "trainer-state/run_state.json",
    ),
    (
        "run_state.json of the wrong shape",
        lambda run: (run / "trainer-state/run_state.json").write_text('{"trainings": "one"}'),
        "trainer-state/run_state.json",
    ),
    ("garbage loop.json", lambda run: (run / "loop.json").write_text("[{]"), "loop.json"),
    (
        "loop.json of the wrong shape",
        lambda run: (run / "loop.json").write_text('[{"iteration": 0}]'),
        "loop.json",
    ),
    (
        "iterations: two",
        lambda run: edit_json(run / "run.json", lambda r: r["config"].update(iterations="two")),
        "run.json",
    ),
    (
        "group_size: 0",
        lambda run: edit_json(run / "run.json", lambda r: r["config"].update(group_size=0)),
        "run.json",
    ),
    (
        "run.json without its run_dir",
        lambda run: edit_json(run / "run.json", lambda r: r["config"].pop("run_dir")),
        "run.json",
    ),
    (
        "run.json without its config",
        lambda run: edit_json(run / "run.json", lambda r: r.pop("config")),
        "run.json",
    ),
    (
        "a sessions.jsonl line []",
        lambda run: append(run / "iter-0/sessions.jsonl", "[]"),
        "sessions.jsonl line 3",
    ),
    (
        "a sessions.jsonl line without session_id",
        lambda run: append(run / "iter-0/sessions.jsonl", json.dumps({**SESSION, "sample_index": 2})),
        "sessions.jsonl line 3",
    ),
    (
        "a sessions.jsonl line of an unknown task",
        lambda run: append(
            run / "iter-0/sessions.jsonl",
            json.dumps({**SESSION, "session_id": "x-1", "sample_index": 2, "task_id": "no-such-task"}),
        ),
        "sessions.jsonl line 3",
    ),
]


def resume(run: Path, *args: str) -> tuple[int, list[str], float]:
    """`polar-mitm loop -o RUN --resume ARGS` in this process: exit code, the non-empty output lines (stdout and
    stderr), seconds. An exception the command lets out fails the test (it would be a traceback)."""
    from typer.testing import CliRunner

    from polar_mitm.cli import app

    started = time.monotonic()
    result = CliRunner().invoke(app, ["loop", "-o", str(run), "--resume", *args], catch_exceptions=False)
    lines = [line for line in result.output.splitlines() if line.strip()]
    return result.exit_code, lines, time.monotonic() - started


def resume_process(run: Path, *args: str) -> tuple[int, list[str], float]:
    """The same as its own process (killed with all it started after 120 s: a check that lets the run through
    starts an engine)."""
    command = [sys.executable, "-m", "polar_mitm", "loop", "-o", str(run), "--resume", *args]
    started = time.monotonic()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    lines = [line for line in output.splitlines() if line.strip()]
    return proc.returncode, lines, time.monotonic() - started


def assert_nothing_started(run: Path) -> None:
    assert not list(run.rglob("_journal")) and not (run / "engine.log").exists()
    assert not (run / "gateway.log").exists()


def test_the_untampered_run_passes_the_check(run_dir):
    from polar_mitm.loop.saved_state import check_saved_run

    cfg = check_saved_run(run_dir)
    assert cfg.run_dir == run_dir.resolve() and cfg.group_size == 2


@pytest.mark.parametrize("name,tamper,named", TAMPERINGS, ids=[t[0] for t in TAMPERINGS])
def test_a_tampered_run_directory_is_one_line_before_anything_starts(run_dir, name, tamper, named):
    tamper(run_dir)
    code, lines, seconds = resume(run_dir)
    assert code != 0 and len(lines) == 1, (code, lines)
    assert "Traceback" not in lines[0] and named in lines[0], lines[0]
    assert str(run_dir) in lines[0]
    assert seconds < 60
    assert_nothing_started(run_dir)


def test_a_recorded_harness_other_than_the_command_line_s_needs_yes(run_dir, tmp_path):
    """Run as its own process: the shell sees exit code ≠ 0 and one line, and the harness never ran."""
    mark = tmp_path / "MARK"
    edit_json(run_dir / "run.json", lambda r: r["config"].update(harness=f"cmd:touch {mark}"))
    code, lines, _ = resume_process(run_dir)
    assert code != 0 and len(lines) == 1, (code, lines)
    assert f"cmd:touch {mark}" in lines[0] and "sdk:openai_chat" in lines[0] and "--yes" in lines[0]
    assert not mark.exists()
    assert_nothing_started(run_dir)
    # Confirmed, the check lets it through: the next check (the task file, missing here) is what stops it now.
    edit_json(run_dir / "run.json", lambda r: r["config"].update(tasks=str(tmp_path / "gone.jsonl")))
    code, lines, _ = resume(run_dir, "--yes")
    assert code != 0 and len(lines) == 1 and "gone.jsonl" in lines[0] and "--yes" not in lines[0], lines
    assert_nothing_started(run_dir)


def test_the_run_state_check_has_the_trainer_s_fields():
    from dataclasses import fields

    from polar_mitm.loop.saved_state import RunStateFile

    assert set(RunStateFile.model_fields) == {f.name for f in fields(RunState)}
