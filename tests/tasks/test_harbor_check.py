"""`polar-mitm tasks check` runs each oracle and verifier in the sandbox a rollout session of the task gets
(issue 41): a hostile solve.sh can read no host file outside its allow-list, not the task's tests (the grader's
files) nor the checker's environment, and reaches no address, not even a server on the host's loopback; and
`--sandbox none` is refused in one line, as a rollout of Harbor tasks refuses it."""

from __future__ import annotations

import asyncio
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from polar_mitm.tasks.harbor import ConvertOptions, convert
from polar_mitm.tasks.harbor_check import check_sandbox, check_task
from polar_mitm.tasks.task_file import load_tasks

POLAR = str(Path(sys.executable).with_name("polar-mitm"))
ENV_SECRET = "env-secret-17"


@pytest.fixture
def loopback_server():
    """A real HTTP server on the host's loopback: its URL (the host itself can reach it)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture
def planted():
    """A secret on the host outside /tmp (a private tmpfs in any sandbox), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="polar-check-planted-", dir="/var/tmp"))
    (folder / "secret.txt").write_text("host-secret-42")
    yield folder / "secret.txt"
    shutil.rmtree(folder)


def harbor_task(root: Path, solve: str) -> Path:
    """A Harbor task whose verifier prints the oracle's report.txt and gives full marks; its task file."""
    folder = root / "src" / "hostile"
    files = {
        "task.toml": '[task]\nname = "test/hostile"\n\n[verifier]\ntimeout_sec = 30.0\n',
        "instruction.md": "Do it.\n",
        "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n",
        "tests/test.sh": "cat /app/report.txt; echo 1 > /logs/verifier/reward.txt\n",
        "solution/solve.sh": solve,
    }
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    out = root / "tasks.jsonl"
    convert([folder], out, ConvertOptions())
    return out


def test_a_checks_oracle_reads_no_host_file_nor_its_tests_and_reaches_no_address(
    tmp_path, planted, loopback_server, monkeypatch
):
    assert "host-secret-42" in planted.read_text()
    subprocess.run(["curl", "-sf", "-m", "5", "-o", "/dev/null", loopback_server], check=True)  # the host can
    monkeypatch.setenv("POLAR_CHECK_SECRET", ENV_SECRET)  # the checker's own environment
    tasks_file = harbor_task(tmp_path, "")
    [task] = load_tasks(tasks_file)
    solve = (
        f"exec > /app/report.txt 2>&1\ncat {planted}; echo planted-rc=$?\n"
        f"cat {task.harbor.tests}/test.sh; echo tests-rc=$?\nls /tests; echo slash-tests-rc=$?\n"
        f"curl -s -m 3 {loopback_server} > /dev/null; echo net-rc=$?\n"
        "echo env=$(env | grep -c POLAR_CHECK_SECRET)\necho ran-as=$(id -u)\n"
    )
    (task.harbor.solution / "solve.sh").write_text(solve)
    result = asyncio.run(check_task(check_sandbox("bwrap"), task))
    report = result.oracle.output
    assert result.oracle.accepted and "ran-as=1000" in report, report  # solve.sh ran, in the sandbox
    assert "host-secret-42" not in report and "planted-rc=1" in report, report
    assert "tests-rc=1" in report and "slash-tests-rc=2" in report, report  # the grader's files: not yet
    assert "net-rc=7" in report, report  # curl: could not connect (no address but its own loopback)
    assert "env=0" in report and ENV_SECRET not in report, report


def test_check_refuses_sandbox_none_in_one_line(tmp_path):
    tasks_file = harbor_task(tmp_path, "echo done\n")
    done = subprocess.run(
        [POLAR, "tasks", "check", str(tasks_file), "--sandbox", "none"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "drop --sandbox none" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
