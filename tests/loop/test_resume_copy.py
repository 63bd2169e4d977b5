"""`polar-mitm loop --resume -o RUN` carries on the run in RUN, wherever it was started (issue 36 item 8): a copy of
a run resumes in the copy without writing into the original or reading from it, and a moved run resumes where it is
now. One real 1-iteration loop (tiny model, scripted policy) is copied and moved; each resumes its last stages."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"
LOOP_ARGS = [
    "-n",
    "1",
    "-g",
    "2",
    "-c",
    "2",
    "--model",
    "tiny",
    "--max-tokens",
    "64",
    "--learning-rate",
    "1e-2",
]
LOOP_ARGS += ["--script", str(EXAMPLES / "policy.json"), "--keep-zero-advantage-groups"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def loop(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "polar_mitm", "loop", *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)


def snapshot(run_dir: Path) -> dict[str, tuple[float, str]]:
    """Every file under `run_dir`: its mtime and content digest."""
    return {
        str(path.relative_to(run_dir)): (path.stat().st_mtime, hashlib.sha256(path.read_bytes()).hexdigest())
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and not path.is_symlink()
    }


def unfinish(run_dir: Path) -> None:
    """Make a finished run resumable as a kill after its training would leave it: the push and the iteration's end
    not done (the resume pushes the trained weights of the folder it runs in, then finishes)."""
    path = run_dir / "iter-0" / "state.json"
    state = json.loads(path.read_text())
    del state["stages"]["push"], state["stages"]["done"]
    path.write_text(json.dumps(state))
    (run_dir / "loop.json").unlink()


def finished_in(run_dir: Path) -> None:
    loop_json = json.loads((run_dir / "loop.json").read_text())
    assert [row["iteration"] for row in loop_json] == [0]
    events = [json.loads(line)["event"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-3:] == ["resume", "iteration_done", "finished"]
    assert json.loads((run_dir / "iter-0" / "state.json").read_text())["stages"].keys() >= {"push", "done"}


@pytest.mark.slow
def test_a_copied_run_resumes_in_the_copy_and_a_moved_one_where_it_is(tmp_path):
    rows = [json.loads(line) for line in (EXAMPLES / "tasks.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        row["workspace"]["dir"] = str((EXAMPLES / row["workspace"]["dir"]).resolve())
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    original = tmp_path / "run"
    started = loop(str(tasks), "-o", str(original), *LOOP_ARGS)
    assert started.returncode == 0, started.stderr[-3000:]

    copy = tmp_path / "copy"
    shutil.copytree(original, copy, symlinks=True, copy_function=shutil.copy2)  # cp -a
    unfinish(copy)
    before = snapshot(original)
    resumed = loop("-o", str(copy), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert snapshot(original) == before  # not one file of the original written, touched or added
    finished_in(copy)
    assert f"run → {copy}" in resumed.stdout.replace("\n", "")

    moved = tmp_path / "moved"
    original.rename(moved)  # mv: nothing is left where the run was started
    unfinish(moved)
    resumed = loop("-o", str(moved), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not original.exists()
    finished_in(moved)
