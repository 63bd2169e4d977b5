"""Limits where no cgroup can be made (issue 41): `POLAR_SESSION_CGROUPS=off` runs a rollout as such a machine
does, and a session's memory and processes fall back to rlimits (polar_mitm/sandbox/limits.py) — a memory hog in the
agent and in its evaluation is refused its allocation (RLIMIT_DATA: MemoryError, where the cgroup's OOM killer
would SIGKILL), and the session's process limit is RLIMIT_NPROC inside its sandbox, which bounds a fork bomb
wherever the sandbox user is not root outside. A rollout of `cmd:` sessions, as a user starts one."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm.sandbox import Limits, SessionBox, get_sandbox

PY = shlex.quote(sys.executable)
HOG = f'{PY} -c \'b = bytearray(512 << 20); b[::4096] = b"x" * len(b[::4096]); print("allocated")\''
MEMORY = f"out=$({HOG} 2>&1); echo \"hog-rc=$? ${{out##*$'\\n'}}\""  # the exit code and the last line
FORK_BOMB = (
    "import os, time\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n            time.sleep(5)\n"
    "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('fork refused', e)\nprint('forked', n)"
)
PROCESSES = f"grep 'Max processes' /proc/self/limits; {PY} -c {shlex.quote(FORK_BOMB)}"


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, str]:
    """task id -> what its session reported, then what its evaluation printed (rollout with cgroups off)."""
    root = tmp_path_factory.mktemp("no-cgroups")
    lines = [
        {
            "task_id": "memory",
            "prompt": MEMORY,
            "eval": f"cat report.txt; {MEMORY}",
            "limits": {"memory_mb": 128},
        },
        {"task_id": "processes", "prompt": PROCESSES, "eval": "cat report.txt", "limits": {"pids": 64}},
    ]
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = [str(Path(sys.executable).with_name("polar-mitm")), "rollout", str(tasks)]
    argv += ["--harness", 'cmd:bash -c "$POLAR_PROMPT" > report.txt 2>&1', "-g", "1", "--sandbox", "bwrap"]
    argv += [
        "--gateway-url",
        "http://127.0.0.1:9",
        "--work-dir",
        str(root / "run"),
        "--out",
        str(root / "flows"),
    ]
    argv += ["--rewards", str(root / "rewards.jsonl")]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=240, env={**os.environ, "POLAR_SESSION_CGROUPS": "off"}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "POLAR_SESSION_CGROUPS=off: no session cgroups" in done.stderr, done.stderr
    rows = [json.loads(line) for line in (root / "rewards.jsonl").read_text().splitlines()]
    return {row["task_id"]: row["eval_output"] for row in rows}


def test_without_a_cgroup_a_memory_hog_is_refused_its_memory_in_the_agent_and_in_the_evaluation(reports):
    report = reports["memory"]
    assert report.count("hog-rc=1 MemoryError") == 2, report  # RLIMIT_DATA; a cgroup would SIGKILL (137)


def test_without_a_cgroup_the_process_limit_is_set_inside_the_sandbox(reports):
    limit = next(line for line in reports["processes"].splitlines() if line.startswith("Max processes"))
    assert limit.split()[2:4] == ["64", "64"], reports["processes"]


@pytest.mark.skipif(
    os.geteuid() == 0,
    reason="run as root, the sandbox user is root outside and the kernel does not apply RLIMIT_NPROC to it: "
    "without a cgroup a session's process count is unbounded (recipes/sandboxes.md)",
)
def test_without_a_cgroup_a_fork_bomb_stops_at_the_process_limit(reports):
    report = reports["processes"]
    assert "fork refused" in report and int(report.split("forked ")[1].split()[0]) < 64, report


def test_a_cgroup_holding_a_limit_takes_it_off_the_rlimits(tmp_path):
    box = SessionBox(tmp_path, limits=Limits(memory_mb=100, pids=50))
    fallback, _ = get_sandbox("bwrap").wrap(box, ["true"], {}, tmp_path)
    assert "--nproc=50:50" in fallback and f"--data={100 << 20}:{100 << 20}" in box.limits.prlimit_argv()
    box.held_by_cgroup = frozenset({"memory", "pids"})
    held, _ = get_sandbox("bwrap").wrap(box, ["true"], {}, tmp_path)
    assert not [a for a in held if a.startswith("--nproc")]
    assert not [a for a in box.limits.prlimit_argv(memory=False) if a.startswith("--data")]
