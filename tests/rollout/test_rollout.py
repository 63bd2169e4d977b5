"""Rollouts: concurrency without lost or misattributed records, timeouts, rewards, straggler cut, READY buffer."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.rollout import session_cgroup
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig, write_rewards
from polar_mitm.storage.records import read_all
from polar_mitm.tasks.task_file import TaskFileError, load_tasks

# A real HTTP client as the "harness": two chat calls through the gateway, each naming its session.
CURL_TWICE = (
    "cmd:for turn in 1 2; do curl -sf {base_url}/v1/chat/completions -H 'content-type: application/json' "
    '-d \'{{"model": "m", "max_tokens": 4, "messages": [{{"role": "user", '
    '"content": "session {session} turn \'$turn\'"}}]}}\' > /dev/null || exit 1; done; echo hello > out.txt'
)


def write_tasks(path: Path, tasks: list[dict]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def task(task_id: str, **extra) -> dict:
    return {"task_id": task_id, "prompt": "p", "eval": {"command": "test -f out.txt"}, **extra}


def run(tasks_file: Path, harness: str, gateway, tmp_path: Path, **cfg):
    config = RolloutConfig(workspace_root=tmp_path / "ws", log_dir=tmp_path / "logs", **cfg)
    endpoints = GatewayEndpoints(gateway.reverse_url, gateway.proxy_url)
    return asyncio.run(Rollout(load_tasks(tasks_file), HarnessSpec(harness), endpoints, config).run())


def test_sixteen_concurrent_sessions_lose_no_record_and_mix_none(gateway, tmp_path):
    tasks = write_tasks(tmp_path / "t.jsonl", [task(f"conc{i}") for i in range(4)])
    summary = run(
        tasks, CURL_TWICE, gateway, tmp_path, group_size=4, concurrency=16, init_workers=4, ready_buffer=16
    )
    assert len(summary.sessions) == 16 and all(s.status == "ok" and s.reward == 1.0 for s in summary.sessions)
    rows = read_all(gateway.out_dir).to_pylist()
    for s in summary.sessions:
        mine = sorted((r for r in rows if r["session_id"] == s.session_id), key=lambda r: r["seq"])
        assert [r["seq"] for r in mine] == [0, 1]
        assert all(f"session {s.session_id} turn" in r["messages_json"] for r in mine)
        assert all(r["task_id"] == s.task.task_id and r["completion_ids"] for r in mine)


def test_timed_out_harness_keeps_its_partial_trace_and_gets_the_failure_reward(gateway, tmp_path):
    one_call_then_hang = CURL_TWICE.replace("for turn in 1 2", "for turn in 1") + "; sleep 60"
    tasks = write_tasks(tmp_path / "t.jsonl", [task("slow", timeouts={"run": 3})])
    started = time.monotonic()
    summary = run(
        tasks, one_call_then_hang, gateway, tmp_path, group_size=2, concurrency=2, failure_reward=-1.0
    )
    assert time.monotonic() - started < 30
    rows = read_all(gateway.out_dir).to_pylist()
    for s in summary.sessions:
        assert s.status == "timeout" and s.reward == -1.0
        assert len([r for r in rows if r["session_id"] == s.session_id]) == 1  # the partial trace


def test_rewards_follow_the_checker_and_are_written(gateway, tmp_path):
    tasks = write_tasks(
        tmp_path / "t.jsonl",
        [
            task("passes"),
            task("fails", eval={"command": "test -f missing.txt"}),
            task("scored", eval={"command": "echo 'score: 0.25'", "reward": "stdout"}),
        ],
    )
    summary = run(tasks, CURL_TWICE, gateway, tmp_path, group_size=2, concurrency=4)
    rewards = {s.task.task_id: s.reward for s in summary.sessions}
    assert rewards == {"passes": 1.0, "fails": 0.0, "scored": 0.25}
    write_rewards(summary, tmp_path / "rewards.parquet")
    table = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert {r["session_id"] for r in table} == {s.session_id for s in summary.sessions}
    assert {r["task_id"]: r["reward"] for r in table} == rewards


def test_straggler_cut_cancels_the_rest_of_a_group(gateway, tmp_path):
    # Sessions 0 and 1 finish at once; 2 and 3 would hang for a minute.
    harness = "cmd:if [ {index} -ge 2 ]; then sleep 60; fi; echo hello > out.txt"
    tasks = write_tasks(tmp_path / "t.jsonl", [task("strag")])
    started = time.monotonic()
    summary = run(tasks, harness, gateway, tmp_path, group_size=4, concurrency=4, keep=2)
    assert time.monotonic() - started < 30
    status = {s.index: s.status for s in summary.sessions}
    assert status == {0: "ok", 1: "ok", 2: "cut", 3: "cut"}
    assert all(s.reward is None for s in summary.sessions if s.status == "cut")
    assert not any((tmp_path / "ws").iterdir())  # cut workspaces were removed too


def test_ready_buffer_keeps_run_workers_busy(gateway, tmp_path):
    tasks = write_tasks(tmp_path / "t.jsonl", [task("slowinit", workspace={"setup": ["sleep 0.6"]})])
    harness = "cmd:sleep 0.3; echo hello > out.txt"
    without = run(tasks, harness, gateway, tmp_path / "a", group_size=8, concurrency=2, ready_buffer=0)
    with_buffer = run(
        tasks, harness, gateway, tmp_path / "b", group_size=8, concurrency=2, ready_buffer=4, init_workers=6
    )
    assert with_buffer.run_utilisation > without.run_utilisation + 0.25
    assert with_buffer.wall_seconds < without.wall_seconds


def test_ready_buffer_starts_sessions_in_task_order_whatever_order_their_init_ends(gateway, tmp_path):
    # The first task's setup is the slow one: prepared side by side, the second would be READY first.
    tasks = write_tasks(
        tmp_path / "t.jsonl", [task("first", workspace={"setup": ["sleep 1"]}), task("second")]
    )
    harness = "cmd:echo hello > out.txt"
    summary = run(
        tasks, harness, gateway, tmp_path, group_size=2, concurrency=1, ready_buffer=4, init_workers=4
    )
    started = sorted(summary.sessions, key=lambda s: s.spans["run"][0])
    assert [(s.task.task_id, s.index) for s in started] == [
        ("first", 0),
        ("first", 1),
        ("second", 0),
        ("second", 1),
    ]


def test_a_daemon_the_harness_left_outside_its_process_group_is_stopped_with_its_session(gateway, tmp_path):
    # `setsid` leaves the harness's process group, as Cline's hub daemon does: killing the group misses it.
    # Unconfined (its host pid is written outside the workspace): the sandboxed case is tests/sandbox/.
    pidfile = tmp_path / "daemon.pid"
    harness = f"cmd:setsid sleep 300 < /dev/null > /dev/null 2>&1 & echo $! > {pidfile}; echo hello > out.txt"
    tasks = write_tasks(tmp_path / "t.jsonl", [task("daemon")])
    [session] = run(tasks, harness, gateway, tmp_path, group_size=1, concurrency=1, sandbox="none").sessions
    assert session.status == "ok" and session.reward == 1.0
    stat = Path(f"/proc/{int(pidfile.read_text())}/stat")
    deadline = time.monotonic() + 10
    while stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (
        not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z"
    )  # gone (or dead, not reaped)


@pytest.mark.skipif(session_cgroup.for_sessions().root is None, reason="needs a writable cgroup file system")
def test_a_daemon_that_clears_its_marker_and_leaves_its_group_is_stopped_with_its_session(gateway, tmp_path):
    """The escape of issue 36: `env -u POLAR_HARNESS_RUN setsid …` from `/` left nothing we found (the marker and
    the process group were all we had); its session's cgroup still holds it. Unconfined, as above."""
    pidfile = tmp_path / "daemon.pid"
    harness = (
        f"cmd:cd / && env -u POLAR_HARNESS_RUN setsid bash -c 'echo $$ > {pidfile}; exec sleep 300' "
        "< /dev/null > /dev/null 2>&1 & sleep 0.5; echo hello > out.txt"
    )
    tasks = write_tasks(tmp_path / "t.jsonl", [task("escape")])
    [session] = run(tasks, harness, gateway, tmp_path, group_size=1, concurrency=1, sandbox="none").sessions
    assert session.status == "ok" and session.reward == 1.0
    stat = Path(f"/proc/{int(pidfile.read_text())}/stat")
    deadline = time.monotonic() + 10
    while stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z"
    groups = [p for p in session_cgroup.for_sessions().root.iterdir() if p.is_dir()]
    assert groups == []  # each session's group is removed after it


def test_task_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(task("ok")) + "\n" + json.dumps({"task_id": "x"}) + "\n")
    with pytest.raises(TaskFileError, match=r"bad.jsonl:2: prompt"):
        load_tasks(bad)
    demo = load_tasks(Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks" / "tasks.jsonl")
    assert [t.task_id for t in demo] == ["hello-file", "fix-typo", "append-done"]
    assert all(t.workspace_dir and t.workspace_dir.is_dir() for t in demo)


def test_relative_workspace_root_still_gives_the_harness_its_workspace(gateway, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tasks = write_tasks(tmp_path / "t.jsonl", [task("rel")])
    config = RolloutConfig(workspace_root=Path("relative-ws"), group_size=1, concurrency=1)
    summary = asyncio.run(
        Rollout(
            load_tasks(tasks),
            HarnessSpec("cmd:echo hello > {workspace}/out.txt"),
            GatewayEndpoints(gateway.reverse_url),
            config,
        ).run()
    )
    assert summary.sessions[0].status == "ok" and summary.sessions[0].reward == 1.0
