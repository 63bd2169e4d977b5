"""The rollout service (issue 40): the real `polar-mitm serve-rollouts` process — its embedded engine playing the
demo's scripted policy, its gateway, uvicorn — driven over HTTP by our `Client`, raw httpx and a client written
from Polar's wire format alone. Sessions are real: the SDK agent through the gateway, `cmd:` harnesses for timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow.compute as pc
import pytest

from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines.router import model_info
from polar_mitm.processes import children, ports
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.service.client import AsyncClient, Client, ServiceError, to_tensors
from polar_mitm.service.models import AgentSpec
from polar_mitm.service.task_requests import line_to_request, request_to_line
from polar_mitm.storage.merged import sequences_in
from polar_mitm.storage.records import read_all
from polar_mitm.storage.service_layout import FLOWS_DIR, STATE_FILE, task_dir
from polar_mitm.tasks.task_file import TaskLine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "cpu_tasks"
TOKEN = "service-test-token-7d1f"


def start_service(
    out: Path, port: int, *extra: str, scripted: bool = True, engine_key: str | None = None
) -> subprocess.Popen:
    env = {
        **os.environ,
        "POLAR_SERVICE_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **({"POLAR_ENGINE_KEY": engine_key} if engine_key else {}),
    }
    argv = [sys.executable, "-m", "polar_mitm", "serve-rollouts", "--out", str(out), "--port", str(port)]
    argv += ["--script", str(EXAMPLES / "policy.json")] if scripted else []
    argv += ["--task-root", str(EXAMPLES), *extra]
    log = open(out.parent / f"{out.name}-{len(list(out.parent.glob('*.log')))}.log", "wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, Path(log.name).read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", headers=AUTH, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(Path(log.name).read_text())


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)


AUTH = {"authorization": f"Bearer {TOKEN}"}
KEPT_TOKENS = 1000


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("service")
    port = ports.free_port()
    # --results-in-memory: about one demo task's traces, so most tests here also read finished tasks back from disk
    proc = start_service(
        root / "out",
        port,
        "--max-sessions",
        "2",
        "--queue-limit",
        "2",
        "--results-in-memory",
        str(KEPT_TOKENS),
    )
    yield f"http://127.0.0.1:{port}", root / "out"
    stop(proc)


def demo_request(task_id: str, samples: int, **changes):
    line = json.loads((EXAMPLES / "tasks.jsonl").read_text().splitlines()[0])
    request = line_to_request({**line, "task_id": task_id}, "sdk:openai_chat", num_samples=samples)
    return request.model_copy(update=changes)


def cmd_request(task_id: str, command: str, check: str = "true", samples: int = 1, **changes):
    line = {"task_id": task_id, "prompt": "p", "eval": check, "timeouts": {"run": 120}}
    return line_to_request(line, f"cmd:{command}", num_samples=samples).model_copy(update=changes)


def test_a_task_line_and_a_request_are_the_same_task_both_ways():
    for raw in (EXAMPLES / "tasks.jsonl").read_text().splitlines():
        line = {**json.loads(raw), "meta": {"source": "x"}}
        request = line_to_request(line, "claude-code", num_samples=4)
        assert request.evaluator.strategy == "command" and request.num_samples == 4
        back = request_to_line(request)
        normal = TaskLine.model_validate(line).model_dump(exclude_defaults=True)
        assert TaskLine.model_validate(back).model_dump(exclude_defaults=True) == normal
        assert line_to_request(back, "claude-code", num_samples=4) == request


def test_polars_harness_names_are_ours_and_agent_timeout_caps_the_run():
    from polar_mitm.harness import HARNESSES
    from polar_mitm.service.models import POLAR_HARNESS_NAMES

    assert set(POLAR_HARNESS_NAMES.values()) <= set(HARNESSES)
    for polar in (
        "claude_code",
        "codex",
        "gemini_cli",
        "hermes",
        "mini_swe_agent",
        "openclaw",
        "openhands_sdk",
        "opencode",
        "pi",
        "qwen_code",
    ):
        assert AgentSpec(harness=polar).harness in HARNESSES, polar
    assert (
        AgentSpec(harness="shell", custom_shell={"command": "echo {prompt}"}).harness == "cmd:echo {prompt}"
    )
    request = cmd_request("capped", "true")  # timeouts.run 120
    assert request_to_line(request)["timeouts"]["run"] == 120
    capped = request.model_copy(update={"metadata": {**request.metadata, "agent_timeout": 30}})
    assert request_to_line(capped)["timeouts"] == {**request.metadata["timeouts"], "run": 30}


ROUTES = [
    ("GET", "/health"),
    ("GET", "/rollout/task/x"),
    ("DELETE", "/rollout/task/x"),
    ("POST", "/rollout/task/submit"),
    ("GET", "/events"),
    ("POST", "/rollout/weights"),
]


def test_every_route_wants_the_token(service):
    url, _ = service
    for method, path in ROUTES:
        assert httpx.request(method, url + path).status_code == 401, path
        wrong = {"authorization": "Bearer nope"}
        assert httpx.request(method, url + path, headers=wrong).status_code == 401, path


def test_bad_requests_are_refused_with_the_field_named(service):
    url, _ = service
    good = cmd_request("bad-cases", "true").model_dump()
    cases = [
        ({**good, "num_samples": 0}, 422, "num_samples"),
        ({**good, "num_sample": 2}, 422, "num_sample"),
        ({k: v for k, v in good.items() if k != "agent"}, 422, "agent"),
        ({**good, "evaluator": None}, 422, "evaluator is required"),
        ({**good, "agent": {"harness": "no-such-harness"}}, 422, "no-such-harness"),
        ({**good, "metadata": {"workspace": {"dir": "missing-folder"}}}, 422, "workspace.dir"),
        ({**good, "metadata": {"min_weight_version": "step-3"}}, 422, "min_weight_version"),
        ({**good, "agent": {"harness": "cmd:true", "env": {"A": "1"}}}, 422, "agent.env"),
        ({**good, "agent": {"harness": "cmd:true", "import_path": "my.Harness"}}, 422, "agent.import_path"),
        ({**good, "agent": {"harness": "shell"}}, 422, "custom_shell"),
        (
            {**good, "agent": {"harness": "shell", "custom_shell": {"command": "true", "cwd": "/"}}},
            422,
            "cwd",
        ),
        ({**good, "agent": {"harness": "pi", "custom_shell": {"command": "true"}}}, 422, "not of pi"),
        ({**good, "metadata": {"agent_timeout": 0}}, 422, "agent_timeout"),
        ({**good, "metadata": {"agent_timeout": True}}, 422, "agent_timeout"),
        ({**good, "evaluator": {**good["evaluator"], "refresh_runtime": True}}, 422, "refresh_runtime"),
        (
            {**good, "runtime": {"image": "python:3.12", "prepare": [{"type": "exec"}]}},
            422,
            "runtime.prepare",
        ),
        ({**good, "runtime": {"image": "python:3.12"}}, 422, "--sandbox bwrap"),  # this service's sandbox
    ]
    for body, code, named in cases:
        response = httpx.post(url + "/rollout/task/submit", json=body, headers=AUTH)
        assert response.status_code == code, (body, response.text)
        assert named in response.text, response.text
    assert httpx.get(url + "/rollout/task/never-submitted", headers=AUTH).status_code == 404
    assert httpx.delete(url + "/rollout/task/never-submitted", headers=AUTH).status_code == 404


def test_sdk_sessions_come_back_as_the_merge_of_their_records(service):
    url, out = service
    with Client(url, token=TOKEN) as client:
        client.submit(demo_request("hello-traces", 2))
        status = client.wait("hello-traces", timeout=180)
    assert (status.status, status.total_sessions, status.completed_sessions) == ("completed", 2, 2)
    records = read_all(out / FLOWS_DIR)
    for result in status.results:
        assert result.status == "COMPLETED" and result.timing.e2e_ms > 0
        mine = records.filter(pc.equal(records["session_id"], result.session_id))
        merged, _ = merge_table(mine, eot_token_id=151645)
        [expected] = list(sequences_in(merged, "merge"))
        [trace] = result.trajectory.traces
        assert trace.prompt_ids + trace.response_ids == expected.input_ids
        assert trace.loss_mask == expected.loss_mask[expected.prompt_len :]
        sampled = [lp for lp, m in zip(expected.logprobs, expected.loss_mask, strict=True) if m][:5]
        assert [lp for lp, m in zip(trace.response_logprobs, trace.loss_mask, strict=True) if m][
            :5
        ] == sampled
        assert sum(trace.loss_mask) == sum(len(ids) for ids in mine["completion_ids"].to_pylist())
        assert trace.reward == result.trajectory.metadata["reward"] in (0.0, 1.0)
        assert trace.metadata["weight_version_min"] is not None
    batch = to_tensors([status])
    assert batch["input_ids"].shape[0] == 2 and set(batch["group_index"]) == {0}
    assert batch["loss_mask"].sum() == sum(sum(r.trajectory.traces[0].loss_mask) for r in status.results)


def client_health_tasks(url: str) -> dict[str, int]:
    with Client(url, token=TOKEN) as client:
        return client.health()["tasks"]


def trace_tokens(status) -> int:
    return sum(len(t.prompt_ids) + len(t.response_ids) for r in status.results for t in r.trajectory.traces)


def test_finished_tasks_results_leave_memory_past_the_budget_and_a_get_reads_them_back(service):
    """A service runs for days: finished tasks keep their results in memory up to --results-in-memory trace tokens,
    the oldest then answer GET from their results file — the same status, each session once."""
    url, _ = service
    with Client(url, token=TOKEN) as client:
        client.submit(demo_request("kept-a", 2))
        first = client.wait("kept-a", timeout=180)
        for task_id in ("kept-b", "kept-c"):
            client.submit(demo_request(task_id, 2))
        later = [client.wait(task_id, timeout=180) for task_id in ("kept-b", "kept-c")]
        kept = client.health()["results_in_memory"]
        again = client.status("kept-a")
    assert sum(trace_tokens(s) for s in (first, *later)) > KEPT_TOKENS  # so the oldest had to leave memory
    assert kept["trace_tokens"] <= KEPT_TOKENS
    assert again == first and again.completed_sessions == 2
    assert client_health_tasks(url)["completed"] >= 3  # tasks let go of whole are still counted


def test_the_token_never_reaches_a_session(service):
    url, _ = service
    with Client(url, token=TOKEN) as client:
        client.submit(
            cmd_request("env-check", "env > env.txt", check=f"! grep -q {TOKEN} env.txt && test -s env.txt")
        )
        [result] = client.wait("env-check", timeout=120).results
    assert result.trajectory.metadata["reward"] == 1.0, result


def sleeping(seconds: str) -> list[int]:
    """Host pids of `sleep SECONDS` processes (a sandboxed session's own pids are its PID namespace's)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "cmdline").read_bytes() == f"sleep\0{seconds}\0".encode():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def workspace_file(out: Path, name: str) -> bool:
    """Whether a session's workspace under the service's OUT holds `name` (what a sandboxed harness can write)."""
    return any((out / "work" / "workspaces").glob(f"*/{name}"))


def test_a_full_queue_is_429_a_running_id_409_and_cancel_keeps_what_finished(service):
    url, out = service
    slow = cmd_request(
        "slow",
        "if [ {index} = 1 ]; then touch slow.started; sleep 120.25; else sleep 2; fi",
        samples=2,
    )
    with Client(url, token=TOKEN) as client:
        client.submit(slow)  # both sessions run (--max-sessions 2): later tasks wait
        with pytest.raises(ServiceError) as running:
            client.submit(slow)
        assert running.value.status_code == 409
        client.submit(cmd_request("queued-1", "true"))
        client.submit(cmd_request("queued-2", "true"))
        response = httpx.post(
            url + "/rollout/task/submit", content=cmd_request("q3", "true").model_dump_json(), headers=AUTH
        )
        assert response.status_code == 429 and response.headers["retry-after"] == "5"
        deadline = time.monotonic() + 60
        while client.status("slow").completed_sessions < 1 or not workspace_file(out, "slow.started"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert sleeping("120.25")
        cancelled = client.cancel("slow")
        assert (cancelled.status, cancelled.completed_sessions) == ("failed", 1)
        assert not sleeping("120.25")  # the harness went with the task
        for task_id in ("queued-1", "queued-2"):  # the queue moves on
            assert client.wait(task_id, timeout=60).status == "completed"
        assert client.status("slow").completed_sessions == 1


class Callbacks(BaseHTTPRequestHandler):
    """A trainer's callback endpoint that fails its first two calls."""

    received: list[dict] = []
    calls = 0

    def do_POST(self):  # noqa: N802 — http.server's name
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if type(self).calls <= 2:
            self.send_response(503)
        else:
            type(self).received.append(body)
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_events_come_in_order_and_the_callback_is_retried(service):
    url, _ = service
    server = ThreadingHTTPServer(("127.0.0.1", 0), Callbacks)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    events: list[dict] = []

    def listen():
        with httpx.stream("GET", url + "/events", headers=AUTH, timeout=None) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1].get("task_id") == "evented" and events[-1].get("status") == "completed":
                        return

    task_events: list[dict] = []

    def listen_to_tasks():  # ?type=task: a trainer waiting for whole tasks is sent no session's stage changes
        with httpx.stream(
            "GET", url + "/events", params={"type": "task"}, headers=AUTH, timeout=None
        ) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    task_events.append(json.loads(line[6:]))
                    if (
                        task_events[-1].get("task_id") == "evented"
                        and task_events[-1]["status"] == "completed"
                    ):
                        return

    listener, task_listener = (threading.Thread(target=f, daemon=True) for f in (listen, listen_to_tasks))
    listener.start()
    task_listener.start()
    time.sleep(0.5)
    callback = f"http://127.0.0.1:{server.server_port}/done"
    with Client(url, token=TOKEN) as client:
        client.submit(
            cmd_request("evented", "echo hi > out.txt", check="test -f out.txt", callback_url=callback)
        )
        [result] = client.wait("evented", timeout=60).results
    listener.join(timeout=30)
    task_listener.join(timeout=30)
    assert {e["type"] for e in task_events} == {"task"}
    assert [e["status"] for e in task_events if e["task_id"] == "evented"] == ["queued", "completed"]
    mine = [e for e in events if e.get("task_id") == "evented"]
    sessions = [e["status"] for e in mine if e["type"] == "session"]
    assert sessions[0] == "REGISTERED" and sessions[-1] == "COMPLETED", sessions
    order = ["REGISTERED", "INITIALIZING", "READY", "RUNNING", "POST_RUN", "COMPLETED"]
    assert [order.index(s) for s in sessions] == sorted(order.index(s) for s in sessions)
    assert [e["status"] for e in mine if e["type"] == "task"] == ["queued", "completed"]
    deadline = time.monotonic() + 20
    while not Callbacks.received and time.monotonic() < deadline:
        time.sleep(0.2)
    server.shutdown()
    assert Callbacks.calls == 3 and Callbacks.received[0]["session_id"] == result.session_id


def test_a_session_waiting_for_its_evaluation_gives_its_run_slot_to_the_next_one(service):
    """--max-sessions 2 and two evaluators: once a session's harness exits, its RUN slot is the next session's, also
    while its evaluation waits for an evaluator (the runner's RUN worker has moved on). The service used to hold the
    slot until an evaluator took the session: here the last two sessions then started only once the first two
    evaluations' 3 s had passed. The task goes in through `Client.run` (listening first, then `submit_many`)."""
    url, _ = service
    running: dict[str, float] = {}
    post_run: dict[str, float] = {}  # POST_RUN: its harness exited; its evaluation (3 s) starts now or queues
    listening = threading.Event()

    def listen() -> None:
        with httpx.stream("GET", url + "/events", headers=AUTH, timeout=None) as stream:
            lines = stream.iter_lines()
            next(lines)  # subscribed
            listening.set()
            for line in lines:
                event = json.loads(line[6:]) if line.startswith("data: ") else {}
                if event.get("task_id") == "quick" and event.get("status") in ("RUNNING", "POST_RUN"):
                    (running if event["status"] == "RUNNING" else post_run)[event["session_id"]] = event[
                        "time"
                    ]
                    if len(running) == 6:
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert listening.wait(30)
    with Client(url, token=TOKEN) as client:
        [status] = client.run([cmd_request("quick", "true", check="sleep 3", samples=6)], timeout=90)
    listener.join(timeout=30)
    assert (status.task_id, status.status, status.completed_sessions) == ("quick", "completed", 6)
    # No evaluation can have ended before the first evaluation started plus its 3 s: every session started by then.
    first_evaluation_ends = min(post_run.values()) + 3.0
    starts = sorted(running.values())
    assert len(starts) == 6 and starts[-1] < first_evaluation_ends, [
        round(t - first_evaluation_ends, 2) for t in starts
    ]


# Polar's SessionTiming refuses fields it does not know (extra="forbid"): ours must be among its names.
POLAR_TIMING = {
    "register_to_init_queue_ms",
    "rollout_dispatch_ms",
    "rollout_result_wait_ms",
    "rollout_pipeline_e2e_ms",
    "init_ms",
    "ready_queue_ms",
    "run_ms",
    "postrun_queue_ms",
    "postrun_ms",
    "e2e_ms",
}


def test_a_client_written_from_polars_wire_format_alone(service):
    """What Polar's own client sends — its TaskRequest's `model_dump()`: every field, each optional one null or at
    its default (AgentSpec's, StrategySpec's, EvaluatorSpec's too) — and reads (the fields it knows)."""
    url, _ = service
    body = {
        "task_id": "polar-client",
        "instruction": "say hi",
        "num_samples": 2,
        "dispatch_priority": 0,
        "early_stop_min_usable_sessions": None,
        "timeout_seconds": 120.0,
        "runtime": None,
        "agent": {
            "harness": "cmd:echo hi",
            "import_path": None,
            "model_name": "openai/Qwen/Qwen3-0.6B",
            "settings": {},
            "env": {},
            "mcp_servers": [],
            "skills_path": None,
        },
        "builder": {"strategy": "per_request", "config": {}},
        "evaluator": {
            "strategy": "command",
            "config": {"command": "true"},
            "env": {},
            "refresh_runtime": False,
        },
        "callback_url": None,
        "metadata": {},
    }
    assert httpx.post(url + "/rollout/task/submit", json=body, headers=AUTH).json() == {
        "task_id": "polar-client",
        "status": "running",
    }
    deadline = time.monotonic() + 60
    while (status := httpx.get(url + "/rollout/task/polar-client", headers=AUTH).json())[
        "status"
    ] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert status["status"] == "completed" and status["total_sessions"] == status["completed_sessions"] == 2
    for result in status["results"]:
        assert set(result) >= {"session_id", "task_id", "status", "trajectory", "timing", "error"}
        assert result["status"] == "COMPLETED" and result["trajectory"]["status"] == "COMPLETED"
        assert {"init_ms", "run_ms", "postrun_ms", "e2e_ms"} <= set(result["timing"]) <= POLAR_TIMING
    refused = httpx.post(
        url + "/rollout/task/submit",
        json={**body, "task_id": "polar-runtime", "runtime": {"backend": "apptainer", "image": "x.sif"}},
        headers=AUTH,
    )
    assert refused.status_code == 422 and "runtime" in refused.text, refused.text
    # Polar's own harness names: its `shell` preset with custom_shell; metadata.agent_timeout stops the run alone.
    shell = {"harness": "shell", "custom_shell": {"command": "echo hi > said.txt; sleep 30", "cwd": None}}
    timed = {
        **body,
        "task_id": "polar-shell",
        "num_samples": 1,
        "agent": {**body["agent"], **shell},
        "evaluator": {**body["evaluator"], "config": {"command": "grep -q hi said.txt"}},
        "metadata": {"agent_timeout": 1.5},
    }
    began = time.monotonic()
    assert httpx.post(url + "/rollout/task/submit", json=timed, headers=AUTH).status_code == 200
    while (status := httpx.get(url + "/rollout/task/polar-shell", headers=AUTH).json())[
        "status"
    ] == "running":
        assert time.monotonic() - began < 25, "agent_timeout did not stop the run"
        time.sleep(0.2)
    [result] = status["results"]
    assert result["status"] == "TIMEOUT" and 1000 <= result["timing"]["run_ms"] < 10_000, result


def test_a_task_waits_for_its_min_weight_version_and_its_traces_say_the_version(service, tiny_model_dir):
    """`metadata.min_weight_version`: no session starts before the engine serves it (pushed here through
    `POST /rollout/weights`); a task whose version never comes ends, at its timeout_seconds, in TIMEOUT results."""
    url, _ = service
    with Client(url, token=TOKEN) as client:
        served = int(client.health()["weight_version"])
        later = demo_request("after-push", 1)
        later = later.model_copy(update={"metadata": {**later.metadata, "min_weight_version": served + 1}})
        client.submit(later)
        client.submit(
            cmd_request(
                "never-pushed", "true", samples=2, timeout_seconds=3.0, metadata={"min_weight_version": 10**6}
            )
        )
        time.sleep(1.5)  # three reads of the engine's version: the task still waits
        waiting = client.status("after-push")
        assert (waiting.status, waiting.completed_sessions) == ("running", 0)
        assert client.health()["running_sessions"] == 0  # nothing was started
        assert client.push_weights(str(tiny_model_dir)) == str(served + 1)
        [result] = client.wait("after-push", timeout=120).results
        assert result.status == "COMPLETED", result.error
        [trace] = result.trajectory.traces
        assert int(trace.metadata["weight_version_min"]) >= served + 1
        assert {int(v) for v in trace.metadata["request_weight_versions"]} == {served + 1}
        expired = client.wait("never-pushed", timeout=60)
    assert expired.status == "completed" and expired.completed_sessions == 2
    assert sorted(r.metadata["sample_index"] for r in expired.results) == [0, 1]
    for session in expired.results:
        assert session.status == "TIMEOUT" and "weight_version ≥ 1000000" in session.error, session


class Acknowledging(BaseHTTPRequestHandler):
    """A trainer's callback endpoint that is down (503) until `up`, then acknowledges each session it gets."""

    up = False
    received: list[str] = []

    def do_POST(self):  # noqa: N802 — http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if type(self).up:
            type(self).received.append(body["session_id"])
        self.send_response(200 if type(self).up else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def two_engines(tmp_path):
    """Two embedded engines (one API key, as a cluster's engines are given), for a service to put behind a router."""
    key = "service-test-engine-key-5b2e9"

    def start(k: int):
        log = tmp_path / f"engine{k}.log"
        return engine_processes.start_engine("tiny", log=log, extra_args=["--threads", "1"], api_key=key)

    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(start, range(2)))
    yield [url for _, url in started], key
    for proc, _ in started:
        children.stop(proc)


def gateway_argv(flows: Path) -> list[str]:
    """The command line of the gateway recording to `flows`."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if f"polar_out={flows}" in argv:
            return argv
    raise AssertionError(f"no gateway records to {flows}")


def test_killed_and_resumed_every_finished_session_is_reported_once_and_the_rest_run(tmp_path, two_engines):
    """kill -9 while a task has some sessions finished and others running, then `--resume`: the finished ones are
    reported once, the rest run again under the sample indices still free, and the callbacks no one acknowledged
    are sent again — once. Also: a real harness CLI (Pi, unmodified) through the service, with the completion
    budget it forces (--max-tokens), on two engines behind a router, whose gateway gets the engines' tokenizer as
    the loop's do (`router.gateway_options`)."""
    (first, second), engine_key = two_engines
    out, port = tmp_path / "out", ports.free_port()
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Acknowledging)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    Acknowledging.up, Acknowledging.received = False, []
    callback = f"http://127.0.0.1:{receiver.server_port}/done"

    def serve(*extra: str) -> subprocess.Popen:
        flags = ("--engine", f"{first},{second}", "--max-tokens", "16", *extra)
        return start_service(out, port, *flags, scripted=False, engine_key=engine_key)

    proc, url = serve(), f"http://127.0.0.1:{port}"
    try:
        tokenizer = model_info(first)["tokenizer_path"]
        with Client(url, token=TOKEN) as client:
            assert client.health()["gateway_options"]["polar_tokenizer"] == tokenizer
            assert f"polar_tokenizer={tokenizer}" in gateway_argv(out / FLOWS_DIR)
            client.submit(cmd_request("pi-says", "x").model_copy(update={"agent": AgentSpec(harness="pi")}))
            [pi] = client.wait("pi-says", timeout=120).results
            assert pi.status == "COMPLETED", pi.error
            [trace] = pi.trajectory.traces
            assert sum(trace.loss_mask) == 16 and trace.finish_reason == "length"  # the forced budget
            records = read_all(out / FLOWS_DIR)
            mine = records.filter(pc.equal(records["session_id"], pi.session_id))
            [completion] = mine["completion_ids"].to_pylist()
            assert [t for t, m in zip(trace.response_ids, trace.loss_mask, strict=True) if m] == completion
            client.submit(cmd_request("fast", "true", samples=2))
            fast = client.wait("fast", timeout=60)
            # The last sample finishes at once, the others are still running at the kill.
            script = "if [ {index} = 2 ]; then true; else touch part.started; sleep 8; fi"
            client.submit(cmd_request("part", script, samples=3, callback_url=callback))
            deadline = time.monotonic() + 60
            while client.status("part").completed_sessions < 1 or not workspace_file(out, "part.started"):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            finished = client.status("part").results
            assert [r.metadata["sample_index"] for r in finished] == [2]
        stop(proc, signal.SIGKILL)  # the service, its router and its gateway at once
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "polar_mitm",
                "serve-rollouts",
                "--out",
                str(out),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
        )
        assert refused.returncode == 2 and "pass --resume" in refused.stderr, refused.stderr
        Acknowledging.up = True  # the trainer is back
        proc = serve("--resume")
        log = proc.log_path.read_text()  # type: ignore[attr-defined]
        assert "resumed 3 task(s)" in log and "2 session(s) to run again" in log, log
        with Client(url, token=TOKEN) as client:
            again = client.status("fast")
            assert again.status == "completed"
            assert [r.session_id for r in again.results] == [r.session_id for r in fast.results]  # each once
            part = client.wait("part", timeout=90)
        assert (part.status, part.completed_sessions) == ("completed", 3)
        ids = [r.session_id for r in part.results]
        assert ids[0] == finished[0].session_id and len(set(ids)) == 3  # reported once, the rest ran again
        assert sorted(r.metadata["sample_index"] for r in part.results) == [0, 1, 2]
        deadline = time.monotonic() + 20
        while len(Acknowledging.received) < 3:  # the one the kill left unacknowledged, sent again
            assert time.monotonic() < deadline, Acknowledging.received
            time.sleep(0.1)
        assert sorted(Acknowledging.received) == sorted(ids)
        stop(proc, signal.SIGKILL)  # acknowledged is on disk: another kill and resume sends none again
        # A kill after a task's last result was written and before its state was: all its results, state running.
        state = task_dir(out, "fast") / STATE_FILE
        state.write_text(json.dumps({**json.loads(state.read_text()), "status": "running"}))
        proc = serve("--resume")
        time.sleep(1.5)
        assert sorted(Acknowledging.received) == sorted(ids)
        with Client(url, token=TOKEN) as client:
            assert [r.session_id for r in client.status("part").results] == ids
            again = client.wait("fast", timeout=30)  # completed with what it had, nothing run again
            assert [r.session_id for r in again.results] == [r.session_id for r in fast.results]
        assert json.loads(state.read_text())["status"] == "completed"
    finally:
        stop(proc)
        receiver.shutdown()


class RefusingFront(BaseHTTPRequestHandler):
    """The service behind a front that answers its first two submits 429 with `Retry-After: 2` (the service's own
    full-queue answer), then passes every request on to the real service."""

    service_url = ""
    submits: list[float] = []

    def do_POST(self):  # noqa: N802 — http.server's name
        submits = type(self).submits
        submits.append(time.monotonic())
        body = self.rfile.read(int(self.headers["content-length"]))
        if len(submits) <= 2:
            status, headers, answer = 429, {"retry-after": "2"}, b'{"detail": "the queue is full"}'
        else:
            passed = httpx.post(
                self.service_url + self.path,
                content=body,
                headers={"authorization": self.headers["authorization"], "content-type": "application/json"},
            )
            status, headers, answer = passed.status_code, {}, passed.content
        self.send_response(status)
        for name, value in {**headers, "content-type": "application/json"}.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def test_async_submit_waits_for_a_service_not_up_and_out_a_full_queue_but_never_retries_a_bad_request(
    service,
):
    """verl's loop submits a whole step at once and may start before the service: a refused connection and a 429
    are waited out (its Retry-After honoured), for at most `submit_wait`; a 422 comes back at once."""
    url, _ = service
    port = ports.free_port()  # nothing listens there for the first half second
    RefusingFront.service_url, RefusingFront.submits = url, []
    fronts: list[ThreadingHTTPServer] = []

    def open_front() -> None:
        fronts.append(ThreadingHTTPServer(("127.0.0.1", port), RefusingFront))
        threading.Thread(target=fronts[0].serve_forever, daemon=True).start()

    opening = threading.Timer(0.5, open_front)
    bad = {**cmd_request("bad-harness", "true").model_dump(), "agent": {"harness": "no-such-harness"}}

    async def submits() -> tuple[str, float, ServiceError, float]:
        async with AsyncClient(f"http://127.0.0.1:{port}", token=TOKEN, submit_wait=30) as client:
            started = time.monotonic()
            [accepted] = await client.submit_many([cmd_request("retried", "true")])
            with pytest.raises(ServiceError) as refused:
                await client.submit(bad)
        async with AsyncClient(f"http://127.0.0.1:{ports.free_port()}", submit_wait=1.5) as nowhere:
            tried = time.monotonic()
            with pytest.raises(httpx.ConnectError):
                await nowhere.submit(cmd_request("never", "true"))
            gave_up = time.monotonic() - tried
        return accepted.task_id, started, refused.value, gave_up

    opening.start()
    try:
        task_id, started, refused, gave_up = asyncio.run(submits())
    finally:
        opening.join()
        fronts[0].shutdown()
        fronts[0].server_close()
    first, second, third, bad_one = RefusingFront.submits
    assert task_id == "retried" and first - started >= 0.4  # refused until the front opened
    assert second - first >= 1.9 and third - second >= 1.9  # Retry-After, not the backoff's 0.5 s and 1 s
    assert (refused.status_code, "no-such-harness" in str(refused.detail)) == (422, True)
    assert bad_one > third  # submitted once: the fourth and last request the front saw
    assert 1.4 <= gave_up < 5
    with Client(url, token=TOKEN) as client:  # the service's own answer came through the front
        assert client.wait("retried", timeout=60).status == "completed"


VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"  # scripts/setup-verl.sh
VERL_RUN = """
import asyncio, json, sys
import hydra
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
from verl.utils.dataset.rl_dataset import RLHFDataset
import polar_mitm.service.verl_agent_loop  # registers `polar_mitm`

url, tokenizer, line = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config = OmegaConf.create(
    {"actor_rollout_ref": {"rollout": {"custom": {"polar_mitm": {"url": url, "harness": "sdk:openai_chat"}}}},
     "data": {}}
)
loop = hydra.utils.instantiate(  # as verl's AgentLoopWorker makes each agent loop
    config=_agent_loop_registry["polar_mitm"],
    trainer_config=DictConfigWrap(config=config),
    server_manager=None,
    tokenizer=AutoTokenizer.from_pretrained(tokenizer),
    processor=None,
    hf_model_type=None,
    dataset_cls=RLHFDataset,
    data_config=DictConfigWrap(config.data),
)
row = {"raw_prompt": [{"role": "user", "content": line["prompt"]}], "extra_info": {"polar_task": line}}
output = asyncio.run(loop.run({"temperature": 1.0}, **row))
print("OUTPUT " + json.dumps({**output.model_dump(exclude={"metrics"}), "type": type(output).__name__}))
# verl's lengths: a response cut at rollout.response_length, then a prompt one token over rollout.prompt_length
loop.rollout_config.prompt_length, loop.rollout_config.response_length = len(output.prompt_ids), 8
cut = asyncio.run(loop.run({"temperature": 1.0}, **row))
print("CUT " + json.dumps(cut.model_dump(exclude={"metrics"})))
loop.rollout_config.prompt_length = len(output.prompt_ids) - 1
try:
    asyncio.run(loop.run({"temperature": 1.0}, **row))
except polar_mitm.service.verl_agent_loop.BridgeError as refused:
    print("REFUSED " + str(refused))
"""


def test_verl_agent_loop_returns_verls_own_output_token_for_token(service, tiny_model_dir):
    """verl's real types on CPU: its registry instantiates our loop, which runs one SDK session through the
    service; the AgentLoopOutput is the session's records, merged."""
    url, out = service
    line = json.loads((EXAMPLES / "tasks.jsonl").read_text().splitlines()[0])
    line["workspace"]["dir"] = str(EXAMPLES / line["workspace"]["dir"])
    env = {**os.environ, "POLAR_SERVICE_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    env.pop("POLAR_SERVICE_URL", None)  # the address comes from verl's config (rollout.custom.polar_mitm)
    done = subprocess.run(
        [str(VERL_PYTHON), "-c", VERL_RUN, url, str(tiny_model_dir), json.dumps(line)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = {
        key: line.split(" ", 1)[1]
        for line in done.stdout.splitlines()
        for key in ("OUTPUT", "CUT", "REFUSED")
        if line.startswith(key + " ")
    }
    output = json.loads(printed["OUTPUT"])
    assert output["type"] == "AgentLoopOutput"
    records = read_all(out / FLOWS_DIR)

    def merged(session):
        mine = records.filter(pc.equal(records["session_id"], session))
        [sequence] = list(sequences_in(merge_table(mine, eot_token_id=151645)[0], "merge"))
        return sequence

    expected = merged(output["extra_fields"]["polar_session_id"])
    assert output["prompt_ids"] + output["response_ids"] == expected.input_ids
    assert output["response_mask"] == expected.loss_mask[expected.prompt_len :]
    sampled = [lp for lp, m in zip(expected.logprobs, expected.loss_mask, strict=True) if m]
    got = [lp for lp, m in zip(output["response_logprobs"], output["response_mask"], strict=True) if m]
    assert got == pytest.approx(sampled, abs=1e-6)
    assert output["reward_score"] in (0.0, 1.0) and output["num_turns"] >= 3
    assert output["extra_fields"]["polar_response_cut"] == 0

    # Over rollout.response_length: cut there as verl's own loops cut (what is kept is exact), and said so.
    cut = json.loads(printed["CUT"])
    expected = merged(cut["extra_fields"]["polar_session_id"])
    response = expected.input_ids[expected.prompt_len :]
    assert len(response) > 8
    assert (
        cut["prompt_ids"] == expected.input_ids[: expected.prompt_len] and cut["response_ids"] == response[:8]
    )
    assert cut["response_mask"] == expected.loss_mask[expected.prompt_len :][:8]
    assert (
        len(cut["response_logprobs"]) == 8 and cut["extra_fields"]["polar_response_cut"] == len(response) - 8
    )
    # Over rollout.prompt_length: refused, naming the option and the length it needs (never left-truncated).
    assert f"rollout.prompt_length={len(output['prompt_ids']) - 1}: set it to at least" in printed["REFUSED"]
