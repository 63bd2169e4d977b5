"""Judges in the rollout service (issue 42 §1): the real `polar-mitm serve-rollouts` started with `--judge-url` at the
scripted judge server (tests/judges/scripted_judge.py, real HTTP), its sessions real (the SDK agent through the
gateway, the embedded engine playing the demo's policy). A task of evaluator strategy `rubric` comes back with
`outcome + weight · score / max` in its traces' reward, a `group` task is judged in one call once both of its
sessions are done, and a judge that is down leaves the outcome under `--judge-failure outcome`, counted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from polar_mitm.processes import ports
from polar_mitm.service.client import Client
from polar_mitm.storage import service_layout as layout
from polar_mitm.storage.judgments import JUDGE_SUMMARY_FILE, read_judgments
from tests.service.test_service import TOKEN, cmd_request, demo_request, start_service, stop

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# The demo policy writes `hello` (the check passes: outcome 1.0) or `Hello` (0.0); the scripted judge's rules score
# the first 4 on a rubric's scale (1.0 in a group), the second -2 (0.0).
RUBRIC_SCORE = {1.0: 4, 0.0: -2}
GROUP_SCORE = {1.0: 1.0, 0.0: 0.0}


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("judge")
    port = ports.free_port()
    argv = [sys.executable, "-m", "tests.judges.scripted_judge", "--port", str(port)]
    proc = subprocess.Popen([*argv, "--log", str(folder / "requests.jsonl")], cwd=ROOT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the scripted judge exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/v1", folder / "requests.jsonl"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def services(tmp_path_factory, judge_url):
    """Two services started at once: one judged by the scripted rules, one whose judge answers 503 (`down`)."""
    url, _ = judge_url

    def serve(model: str):
        out, port = tmp_path_factory.mktemp(model) / "out", ports.free_port()
        judge = [
            "--judge-url",
            url,
            "--judge-model",
            model,
            "--judge-retries",
            "1",
            "--judge-failure",
            "outcome",
        ]
        return start_service(out, port, "--max-sessions", "4", *judge), f"http://127.0.0.1:{port}", out

    with ThreadPoolExecutor(2) as pool:
        started = dict(zip(("scripted", "down"), pool.map(serve, ("scripted", "down")), strict=True))
    yield {model: (service, out) for model, (_, service, out) in started.items()}
    for proc, _, _ in started.values():
        stop(proc)


def judged_request(task_id: str, samples: int, judge: dict):
    request = demo_request(task_id, samples)
    config = {"judge": judge, **request.evaluator.config}
    return request.model_copy(
        update={"evaluator": request.evaluator.model_copy(update={"strategy": "rubric", "config": config})}
    )


def outcome(result) -> float:
    judgment = result.trajectory.metadata["judge"]
    assert judgment["session_id"] == result.session_id
    return judgment["outcome"]


def test_rubric_and_group_tasks_come_back_with_their_judged_rewards(services, judge_url):
    service, out = services["scripted"]
    with Client(service, token=TOKEN) as client:
        client.submit(judged_request("rubric", 2, {"mode": "rubric", "rubric": "out.txt holds hello"}))
        client.submit(judged_request("group", 2, {"mode": "group", "weight": 0.5}))
        rubric, group = client.wait("rubric", timeout=180), client.wait("group", timeout=180)
    calls = set()
    for status, expected in (
        (rubric, lambda o: o + 0.2 * RUBRIC_SCORE[o] / 5),
        (group, lambda o: o + 0.5 * GROUP_SCORE[o]),
    ):
        assert (status.status, status.completed_sessions) == ("completed", 2)
        kept = read_judgments(layout.judgments_dir(layout.task_dir(out, status.task_id)))
        for result in status.results:
            assert result.status == "COMPLETED", result.error
            [trace] = result.trajectory.traces
            assert trace.reward == pytest.approx(expected(outcome(result)))
            assert result.trajectory.metadata["reward"] == trace.reward == kept[result.session_id].reward
            assert kept[result.session_id].status in ("judged", "cached")  # two alike sessions: one call
        calls |= {judgment.call for judgment in kept.values()}
        if status is group:  # one call judged both sessions, once both were done
            assert len({judgment.call for judgment in kept.values()}) == 1
    asked = [json.loads(line)["body"]["model"] for line in judge_url[1].read_text().splitlines()]
    assert asked.count("scripted") == len(calls)  # each judged content asked once, the rest from the cache
    summary = json.loads(
        (layout.judgments_dir(layout.task_dir(out, "rubric")) / JUDGE_SUMMARY_FILE).read_text()
    )
    assert (summary["sessions"], summary["failed"]) == (2, 0)


def test_a_judge_that_is_down_leaves_the_outcome_and_is_counted(services):
    service, out = services["down"]  # the scripted judge answers 503 to model `down`
    with Client(service, token=TOKEN) as client:
        client.submit(judged_request("down", 1, {"mode": "rubric", "rubric": "out.txt holds hello"}))
        status = client.wait("down", timeout=180)
    [result] = status.results
    assert result.status == "COMPLETED"
    [trace] = result.trajectory.traces
    assert trace.reward == outcome(result) in (0.0, 1.0)
    assert result.trajectory.metadata["judge"]["status"] == "failed"
    summary = json.loads(
        (layout.judgments_dir(layout.task_dir(out, "down")) / JUDGE_SUMMARY_FILE).read_text()
    )
    assert (summary["sessions"], summary["failed"], summary["failure"]) == (0, 1, "outcome")


def test_a_session_held_for_its_groups_judge_is_judged_after_a_kill_not_run_again(judge_url, tmp_path):
    """Mode group: sample 0 finishes and waits (held) for sample 1; kill -9, then `--resume`. The held session is
    judged with its group from what was kept of it (held.jsonl, its harness log), not run again; sample 1 runs
    again; one judge call ranks both."""
    out, port = tmp_path / "out", ports.free_port()
    judge = ["--judge-url", judge_url[0], "--judge-model", "scripted", "--max-sessions", "2"]
    script = "echo 'ran: echo hello > out.txt'; echo hello > out.txt; if [ {index} = 1 ]; then sleep 8; fi"
    request = cmd_request("held", script, check="grep -qx hello out.txt", samples=2)
    config = {"judge": {"mode": "group", "weight": 0.5}, **request.evaluator.config}
    evaluator = request.evaluator.model_copy(update={"strategy": "rubric", "config": config})
    held_file = layout.task_dir(out, "held") / layout.HELD_FILE
    proc = start_service(out, port, *judge)
    try:
        with Client(f"http://127.0.0.1:{port}", token=TOKEN) as client:
            client.submit(request.model_copy(update={"evaluator": evaluator}))
            deadline = time.monotonic() + 60
            while not (held_file.exists() and held_file.read_text().strip()):
                assert time.monotonic() < deadline, "no session was held"
                time.sleep(0.1)
            [held] = [json.loads(line) for line in held_file.read_text().splitlines()]
            assert held["index"] == 0 and client.status("held").completed_sessions == 0
        stop(proc, signal.SIGKILL)
        proc = start_service(out, port, "--resume", *judge)
        with Client(f"http://127.0.0.1:{port}", token=TOKEN) as client:
            status = client.wait("held", timeout=120)
    finally:
        stop(proc)
    assert (status.status, status.completed_sessions) == ("completed", 2)
    by_index = {r.metadata["sample_index"]: r for r in status.results}
    assert by_index[0].session_id == held["session_id"]  # the held session, not a new run of sample 0
    kept = read_judgments(layout.judgments_dir(layout.task_dir(out, "held")))
    assert set(kept) == {r.session_id for r in status.results}
    assert len({judgment.call for judgment in kept.values()}) == 1  # one call ranked both
    for result in status.results:
        assert result.status == "COMPLETED", result.error
        assert result.trajectory.metadata["reward"] == pytest.approx(1.0 + 0.5 * GROUP_SCORE[1.0])
