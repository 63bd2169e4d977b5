"""Hostile sessions in bwrap (issue 41): each `cmd:` session first makes a model call through the gateway (it must
be answered and recorded), then tries one thing a sandbox must stop — read a planted host file, write outside its
workspace, reach the engine, call the gateway's control path, see another session's workspace, leave a daemon with a
cleaned environment, fill /tmp, write a file past its size limit, fork past pids.max, allocate past memory.max.
One rollout runs them all side by side (group size 1); each test reads one session's report."""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig
from polar_mitm.storage.records import read_all
from polar_mitm.tasks.task_file import load_tasks

REPO = Path(__file__).resolve().parents[2]  # the checkout, wherever it is (CI clones it elsewhere)

DAEMON_MARK = "314.159"  # `sleep 314.159`: the daemon a session leaves, found on the host by its command line
MODEL_CALL = (
    "curl -sf {base_url}/v1/chat/completions -H 'content-type: application/json' "
    '-d \'{{"model": "m", "max_tokens": 4, "messages": [{{"role": "user", "content": "hi"}}]}}\' '
    "> answer.json || exit 9"
)
# The model call, then the prompt (the attack) with its output in report.txt; the session itself succeeds.
HARNESS = f'cmd:{MODEL_CALL}; bash -c "$POLAR_PROMPT" > report.txt 2>&1; echo "rc=$?" >> report.txt'


def attacks(secret: Path, run_dir: Path, engine_url: str) -> dict[str, tuple[str, dict]]:
    """task id -> (the shell the session runs, its task line's extras)."""
    py = shlex.quote(sys.executable)
    fork_count = (
        "import os, time\nn = 0\ntry:\n    while n < 500:\n        if os.fork() == 0:\n            time.sleep(20)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('fork refused', e)\nprint('forked', n)"
    )
    return {
        "read-host": (
            f"cat {secret}; cat {run_dir}/logs/*.log; ls {REPO}/runs; ls /root/.ssh; echo root=$(ls -A /root); "
            "echo shadow=$(grep -c : /etc/shadow 2>/dev/null)",
            {},
        ),
        "write-out": (
            f"for p in /usr/pwned /etc/pwned {run_dir}/pwned {REPO}/polar_mitm/pwned "
            "$(dirname $POLAR_WORKSPACE)/pwned-beside; do touch $p && echo wrote $p; done; echo tried",
            {},
        ),
        "engine": (f"curl -s -m 3 {engine_url}/health; echo engine-rc=$?", {}),
        "control": (
            "curl -s -o /dev/null -w 'control=%{http_code}\\n' -X POST ${POLAR_BASE_URL%%/t/*}/_polar/control "
            "-d '{}'; ls /proc | grep -cE '^[0-9]+$' | sed 's/^/procs=/'; cat /proc/[0-9]*/cmdline | tr '\\0' ' '; "
            "echo; cat /proc/[0-9]*/environ | tr '\\0' '\\n'",
            {},
        ),
        "peer": ("echo peer-secret > peer-secret.txt; sleep 2; echo peer", {}),
        "neighbours": ("sleep 1; ls -a $(dirname $POLAR_WORKSPACE); echo listed", {}),
        "daemon": (
            f"env -u POLAR_HARNESS_RUN setsid sleep {DAEMON_MARK} < /dev/null > /dev/null 2>&1 & echo started",
            {},
        ),
        "fill-tmp": (
            "dd if=/dev/zero of=/tmp/fill bs=1M count=64; stat -c size=%s /tmp/fill",
            {"limits": {"tmp_mb": 16}},
        ),
        "big-file": (
            "dd if=/dev/zero of=big bs=1M count=32; echo dd-rc=$?",
            {"limits": {"file_size_mb": 8}},
        ),
        "fork-bomb": (f"{py} -c {shlex.quote(fork_count)}", {"limits": {"pids": 64}}),
        "memory": (
            f'{py} -c \'b = bytearray(512 << 20); b[::4096] = b"x" * len(b[::4096]); print("allocated")\'; '
            "echo mem-rc=$?",
            {"limits": {"memory_mb": 128}},
        ),
    }


@pytest.fixture(scope="module")
def hostile(gateway, scripted_engine_url, tmp_path_factory):
    """One rollout of every attack in bwrap; (sessions by task id, their reports, the run dir, the records)."""
    run_dir = tmp_path_factory.mktemp("hostile-run")
    secret = run_dir / "secret.txt"
    secret.write_text("host-secret-42")
    table = attacks(secret, run_dir, scripted_engine_url)
    lines = [
        {"task_id": tid, "prompt": command, "eval": "true", "timeouts": {"run": 60}, **extra}
        for tid, (command, extra) in table.items()
    ]
    tasks_file = run_dir / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = RolloutConfig(
        group_size=1,
        concurrency=len(lines),
        ready_buffer=len(lines),
        init_workers=4,
        workspace_root=run_dir / "workspaces",
        log_dir=run_dir / "logs",
        keep_workspaces=True,
        sandbox="bwrap",
    )
    endpoints = GatewayEndpoints(gateway.reverse_url, gateway.proxy_url, gateway.ca_bundle())
    rollout = Rollout(load_tasks(tasks_file), HarnessSpec(HARNESS), endpoints, config)
    summary = asyncio.run(rollout.run())
    sessions = {s.task.task_id: s for s in summary.sessions}
    reports = {tid: (s.workspace / "report.txt").read_text() for tid, s in sessions.items()}
    return sessions, reports, run_dir, read_all(gateway.out_dir).to_pylist()


def test_every_hostile_session_still_gets_its_model_call_answered_and_recorded(hostile):
    sessions, reports, _, rows = hostile
    for tid, s in sessions.items():
        assert s.status == "ok", (tid, s.eval_output, reports.get(tid))
        assert "choices" in json.loads((s.workspace / "answer.json").read_text())
        assert [r for r in rows if r["session_id"] == s.session_id and r["completion_ids"]], tid


def test_a_planted_host_file_and_the_run_directory_cannot_be_read(hostile):
    report = hostile[1]["read-host"]
    assert "host-secret-42" not in report
    assert report.count("No such file or directory") >= 4, report  # secret, logs, runs/, /root/.ssh
    assert "root=.pyenv\n" in report, report  # of /root, only the Python toolchain the venvs were made from
    # root-only on the host, the sandbox user's in its user namespace: /dev/null stands in for it
    assert "shadow=\n" in report or "shadow=0\n" in report, report


def test_nothing_outside_the_workspace_can_be_written(hostile):
    _, reports, run_dir, _ = hostile
    # The run dir's path exists inside only as the private /tmp's folders above the workspace bind: a write there
    # lands in that tmpfs, never on the host.
    assert reports["write-out"].count("Read-only file system") == 3, reports["write-out"]
    for path in (
        Path("/usr/pwned"),
        Path("/etc/pwned"),
        run_dir / "pwned",
        REPO / "polar_mitm" / "pwned",
    ):
        assert not path.exists()
    assert not (run_dir / "workspaces" / "pwned-beside").exists()


def test_the_engine_port_is_unreachable(hostile):
    report = hostile[1]["engine"]
    assert "engine-rc=7" in report, report  # curl: couldn't connect (the sandbox's loopback has no engine)


def test_the_control_path_refuses_and_no_foreign_process_is_visible(hostile, gateway):
    report = hostile[1]["control"]
    assert "control=403" in report, report
    # no gateway, no engine (started as `polar_mitm.engine.cli`, or as `polar-mitm serve`), no other command
    assert not any(name in report for name in ("mitmdump", "polar_mitm.engine.cli", "polar_mitm.cli")), report
    assert gateway.control_token is None or gateway.control_token not in report
    procs = int(report.split("procs=")[1].split()[0])
    assert procs < 10, report  # bwrap's init, bash, curl/ls/cat: its own PID namespace


def test_another_sessions_workspace_is_not_there(hostile):
    sessions, reports, _, _ = hostile
    listing = reports["neighbours"].split()
    assert sessions["neighbours"].workspace.name in listing
    assert sessions["peer"].workspace.name not in listing, reports["neighbours"]
    assert (sessions["peer"].workspace / "peer-secret.txt").exists()  # it was there on the host all along


def test_a_daemon_with_a_cleaned_environment_ends_with_its_session(hostile):
    assert "started" in hostile[1]["daemon"]
    time.sleep(0.5)
    found = subprocess.run(["pgrep", "-f", f"sleep {DAEMON_MARK}"], capture_output=True, text=True)
    assert found.stdout.strip() == "", found.stdout


def test_filling_tmp_stops_at_its_tmpfs_size(hostile):
    report = hostile[1]["fill-tmp"]
    assert "No space left on device" in report, report
    assert int(report.split("size=")[1].split()[0]) <= 16 * 1024 * 1024, report


def test_a_file_past_the_file_size_limit_is_refused(hostile):
    sessions, reports, _, _ = hostile
    big = sessions["big-file"].workspace / "big"
    assert big.stat().st_size <= 8 * 1024 * 1024, reports["big-file"]
    assert "dd-rc=0" not in reports["big-file"]


def test_a_fork_bomb_stops_at_pids_max(hostile):
    report = hostile[1]["fork-bomb"]
    assert "fork refused" in report, report
    forked = int(report.split("forked ")[1].split()[0])
    assert forked < 64, report


def test_memory_past_its_limit_is_not_given(hostile):
    report = hostile[1]["memory"]
    assert "mem-rc=137" in report, report  # SIGKILL: the cgroup's OOM killer, not a MemoryError we raised
