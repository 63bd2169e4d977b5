"""Choosing a sandbox (issue 41): `--sandbox none` is said as a one-line warning, a kind that cannot run here is a
one-line error with exit 2 before any session starts, and podman/docker build the command line of the same
contract as bwrap (no engine runs on these machines, so their argv is what is tested)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm.sandbox import Limits, SandboxUnavailable, SessionBox, get_sandbox
from polar_mitm.sandbox import bwrap as bwrap_module
from polar_mitm.sandbox.container import Container
from polar_mitm.sandbox.tunnel import SOCKETS_INSIDE, TunnelError, gateway_ports


def rollout(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"task_id": "t", "prompt": "p", "eval": "true"}) + "\n")
    argv = [sys.executable, "-m", "polar_mitm", "rollout", str(tasks), "--harness", "cmd:true"]
    argv += ["--gateway-url", "http://127.0.0.1:9", "--work-dir", str(tmp_path / "run"), "-g", "1"]
    argv += ["--out", str(tmp_path / "flows"), "--rewards", str(tmp_path / "rewards.jsonl"), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_a_container_sandbox_without_an_image_is_a_one_line_error_and_exit_2(tmp_path):
    done = rollout(tmp_path, "--sandbox", "podman")
    assert done.returncode == 2, done.stderr
    assert "--sandbox podman needs --image IMAGE" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unknown_kind_is_refused(tmp_path):
    done = rollout(tmp_path, "--sandbox", "chroot")
    assert done.returncode == 2 and "choose one of none, bwrap, podman, docker" in done.stderr


def test_none_prints_one_warning_line(tmp_path):
    done = rollout(tmp_path, "--sandbox", "none")
    assert done.stderr.count("--sandbox none: sessions run unconfined") == 1, done.stderr


def test_bwrap_missing_is_unavailable_with_the_setup_script_named(monkeypatch):
    monkeypatch.setattr(bwrap_module.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="scripts/setup-sandbox.sh"):
        get_sandbox("bwrap")


def test_a_gateway_off_loopback_cannot_be_tunnelled():
    assert gateway_ports("http://127.0.0.1:8081", "http://localhost:8080", None) == [8081, 8080]
    with pytest.raises(TunnelError, match="not on loopback"):
        gateway_ports("http://10.0.0.5:8081")


def test_podman_argv_has_the_same_contract_as_bwrap(tmp_path):
    box = SessionBox(
        tmp_path / "ws",
        workspace_inside=Path("/app"),
        ports=[8081],
        sockets=tmp_path / "sock",
        limits=Limits(memory_mb=256, pids=50, open_files=100, file_size_mb=8, tmp_mb=16),
    )
    argv, host_env = Container("podman", "debian:bookworm").wrap(
        box, ["agent", str(tmp_path / "ws" / "f")], {"PATH": "/usr/bin", "SECRET": "x"}, tmp_path / "ws"
    )
    text = " ".join(argv)
    for expected in (
        "run --rm --init --network none --cap-drop ALL",
        "--read-only",
        "--memory 256m --pids-limit 50",
        "--ulimit nofile=100:100",
        f"--ulimit fsize={8 << 20}:{8 << 20}",
        "--tmpfs /tmp:rw,size=16m",
        f"-v {tmp_path / 'ws'}:/app:rw",
        f"-v {tmp_path / 'sock'}:{SOCKETS_INSIDE}:rw",
        "-w /app",
        "-e HOME=/home/sandbox",
        "debian:bookworm bash -c socat TCP-LISTEN:8081,bind=127.0.0.1",
    ):
        assert expected in text, expected
    assert argv[-2:] == ["agent", "/app/f"]  # the workspace path relocated where the container sees it
    assert "SECRET" not in host_env  # the launch's variables go in with -e, the engine gets only PATH


def test_a_grader_runs_in_the_sessions_sandbox_with_its_own_folders(tmp_path):
    """The POST stage's way in for graders (Harbor's /tests and /logs): the workspace at the workdir, the given
    folders writable at their paths, nothing else of the host, the grader's env over the evaluation's."""
    from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
    from polar_mitm.rollout.runner import Rollout, RolloutConfig
    from polar_mitm.tasks.task_file import HarborEval, Task

    tests, logs, workspace = tmp_path / "tests", tmp_path / "logs", tmp_path / "ws" / "s"
    for folder in (tests, logs, workspace):
        folder.mkdir(parents=True)
    (tests / "test.sh").write_text("echo graded")
    (workspace / "answer.txt").write_text("42")
    task = Task("t", "p", harbor=HarborEval(tests=tests, workdir="/app"))
    config = RolloutConfig(workspace_root=tmp_path / "ws", group_size=1, sandbox="bwrap")
    rollout = Rollout([task], HarnessSpec("cmd:true"), GatewayEndpoints("http://127.0.0.1:9"), config)
    session = rollout.sessions[0]
    session.workspace = workspace
    run = rollout.sandboxed_command(session, {"/tests": tests, "/logs": logs})
    script = 'bash /tests/test.sh; cat answer.txt; echo "$MINE" > /logs/reward.txt; pwd; ls ' + str(tmp_path)
    code, out = asyncio.run(run(["bash", "-c", script], "/app", 30, {"MINE": "1.0"}))
    assert "graded\n42/app\n" in out, out  # answer.txt has no newline
    assert (logs / "reward.txt").read_text() == "1.0\n"
    assert "No such file or directory" in out  # the test's own folder (beside the workspace) is not there
    assert code != 0
