"""A given engine is checked before any session starts (issue 38): `rollout --engine URL` and `loop --engine URL`
with nothing there used to run every session, score each 0.0 and exit 0. Now: one line naming the option and the
URL, exit 2, nothing written; `grpo --push-to-engine URL` says so before it trains, not after."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.engines import router
from polar_mitm.processes.ports import free_port

TASKS = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks" / "tasks.jsonl"


@pytest.mark.parametrize("command,out", [("rollout", "--out"), ("loop", "-o")])
def test_nothing_at_the_engine_url_is_one_line_and_exit_2_before_anything_runs(tmp_path, command, out):
    dead = f"http://127.0.0.1:{free_port()}"
    args = [command, str(TASKS), "--engine", dead, out, str(tmp_path / "out")]
    if command == "rollout":
        args += ["--work-dir", str(tmp_path / "work")]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"--engine {dead}: nothing answers at {dead}/health" in lines[0], lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_every_engine_of_a_comma_list_is_checked(engine_url):
    dead = f"http://127.0.0.1:{free_port()}"
    router.check_answering(engine_url)  # a real engine answers
    with pytest.raises(router.EngineUnreachable, match=f"--engine {dead}: nothing answers"):
        router.check_answering(f"{engine_url},{dead}")


def test_an_engine_that_is_not_ready_is_named_with_its_status():
    class NotReady(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotReady)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(router.EngineUnreachable, match="/health answered HTTP 503"):
            router.check_answering(url, option="--push-to-engine")
    finally:
        server.shutdown()


def test_grpo_checks_its_push_target_before_it_trains(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    args = ["grpo", "--data", str(tmp_path), "--push-to-engine", dead, "-o", str(tmp_path / "run")]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"--push-to-engine {dead}: nothing answers" in lines[0] and not (tmp_path / "run").exists()
