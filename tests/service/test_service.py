"""The rollout service (issue 40): the real `polar-mitm serve-rollouts` process — its embedded engine playing the
demo's scripted policy, its gateway, uvicorn — driven over HTTP by our `Client`, raw httpx and a client written
from Polar's wire format alone. Sessions are real: the SDK agent through the gateway, `cmd:` harnesses for timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow.compute as pc
import pytest

from polar_mitm.processes import ports
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.service.client import Client, ServiceError, to_tensors
from polar_mitm.service.models import AgentSpec
from polar_mitm.service.task_requests import line_to_request, request_to_line
from polar_mitm.storage.merged import sequences_in
from polar_mitm.storage.records import read_all
from polar_mitm.storage.service_layout import FLOWS_DIR
from polar_mitm.tasks.task_file import TaskLine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "cpu_tasks"
TOKEN = "service-test-token-7d1f"


def start_service(out: Path, port: int, *extra: str, scripted: bool = True) -> subprocess.Popen:
    env = {
        **os.environ,
        "POLAR_SERVICE_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    argv = [sys.executable, "-m", "polar_mitm.cli", "serve-rollouts", "--out", str(out), "--port", str(port)]
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


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("service")
    port = ports.free_port()
    proc = start_service(root / "out", port, "--max-sessions", "2", "--queue-limit", "2")
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


def test_every_route_wants_the_token(service):
    url, _ = service
    for method, path in [("GET", "/health"), ("GET", "/rollout/task/x"), ("POST", "/rollout/task/submit")]:
        assert httpx.request(method, url + path).status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert httpx.request(method, url + path, headers=wrong).status_code == 401


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

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    time.sleep(0.5)
    callback = f"http://127.0.0.1:{server.server_port}/done"
    with Client(url, token=TOKEN) as client:
        client.submit(
            cmd_request("evented", "echo hi > out.txt", check="test -f out.txt", callback_url=callback)
        )
        [result] = client.wait("evented", timeout=60).results
    listener.join(timeout=30)
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


def test_a_client_written_from_polars_wire_format_alone(service):
    """What Polar's own client sends (plain dicts, its field names) and reads (the fields it knows)."""
    url, _ = service
    body = {
        "task_id": "polar-client",
        "instruction": "say hi",
        "num_samples": 2,
        "timeout_seconds": 120,
        "agent": {"harness": "cmd:echo hi"},
        "builder": {"strategy": "per_request", "config": {}},
        "evaluator": {"strategy": "command", "config": {"command": "true"}, "env": {}},
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
        assert {"init_ms", "run_ms", "postrun_ms", "e2e_ms"} <= set(result["timing"])


def test_killed_and_resumed_every_finished_session_is_reported_once_and_the_rest_run(tmp_path):
    """Also: a real harness CLI (Pi, unmodified) through the service, on the tiny model with the completion budget
    the service forces (--max-tokens)."""
    out, port = tmp_path / "out", ports.free_port()
    proc = start_service(out, port, "--max-tokens", "16", scripted=False)
    url = f"http://127.0.0.1:{port}"
    try:
        with Client(url, token=TOKEN) as client:
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
            client.submit(cmd_request("slow", "touch slow.started; sleep 6", samples=2))
            deadline = time.monotonic() + 60
            while not workspace_file(out, "slow.started"):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        stop(proc, signal.SIGKILL)  # the service, its engine and its gateway at once
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "polar_mitm.cli",
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
        proc = start_service(out, port, "--resume", "--max-tokens", "16", scripted=False)
        assert "resumed 3 task(s)" in proc.log_path.read_text()  # type: ignore[attr-defined]
        with Client(url, token=TOKEN) as client:
            again = client.status("fast")
            assert again.status == "completed"
            assert [r.session_id for r in again.results] == [r.session_id for r in fast.results]  # each once
            slow = client.wait("slow", timeout=90)
        assert (slow.status, slow.completed_sessions) == ("completed", 2)
    finally:
        stop(proc)


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
    {"actor_rollout_ref": {"rollout": {"polar_mitm": {"url": url, "harness": "sdk:openai_chat"}}}, "data": {}}
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
"""


def test_verl_agent_loop_returns_verls_own_output_token_for_token(service, tiny_model_dir):
    """verl's real types on CPU: its registry instantiates our loop, which runs one SDK session through the
    service; the AgentLoopOutput is the session's records, merged."""
    url, out = service
    line = json.loads((EXAMPLES / "tasks.jsonl").read_text().splitlines()[0])
    line["workspace"]["dir"] = str(EXAMPLES / line["workspace"]["dir"])
    env = {**os.environ, "POLAR_SERVICE_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(VERL_PYTHON), "-c", VERL_RUN, url, str(tiny_model_dir), json.dumps(line)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = json.loads(done.stdout.split("OUTPUT ", 1)[1])
    assert output["type"] == "AgentLoopOutput"
    session = output["extra_fields"]["polar_session_id"]
    records = read_all(out / FLOWS_DIR)
    mine = records.filter(pc.equal(records["session_id"], session))
    [expected] = list(sequences_in(merge_table(mine, eot_token_id=151645)[0], "merge"))
    assert output["prompt_ids"] + output["response_ids"] == expected.input_ids
    assert output["response_mask"] == expected.loss_mask[expected.prompt_len :]
    sampled = [lp for lp, m in zip(expected.logprobs, expected.loss_mask, strict=True) if m]
    got = [lp for lp, m in zip(output["response_logprobs"], output["response_mask"], strict=True) if m]
    assert got == pytest.approx(sampled, abs=1e-6)
    assert output["reward_score"] in (0.0, 1.0) and output["num_turns"] >= 3
