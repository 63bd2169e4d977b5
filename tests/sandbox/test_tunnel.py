"""The sandbox's way out (polar_mitm/sandbox/tunnel.py): a session under a deep $TMPDIR still reaches its gateway.

Why: a Unix socket's path must fit 107 bytes, and the tunnel's sockets lived under $TMPDIR — a pytest worker's
tmp_path, or a job scheduler's scratch folder, is deep enough to pass it, and then every session of a rollout
crashed in 0.0 s with "AF_UNIX path too long" (CI found it through README's rollout block)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from polar_mitm.sandbox import get_sandbox
from polar_mitm.sandbox.tunnel import LONGEST_SOCKET_TAIL, SUN_PATH_MAX, socket_folder


@pytest.fixture
def deep_tmpdir(tmp_path: Path) -> Path:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert len(str(deep)) + LONGEST_SOCKET_TAIL > SUN_PATH_MAX
    return deep


def test_the_socket_folder_leaves_a_deep_tmpdir_for_a_short_one(deep_tmpdir, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(deep_tmpdir))
    folder = socket_folder()
    try:
        assert len(str(folder / "65535.sock")) <= SUN_PATH_MAX
        assert not folder.is_relative_to(deep_tmpdir)
        assert folder.stat().st_mode & 0o077 == 0  # private, as mkdtemp makes it
    finally:
        folder.rmdir()


def test_the_socket_folder_stays_in_a_short_tmpdir(monkeypatch):
    short = Path("/tmp")
    monkeypatch.setattr("tempfile.tempdir", str(short))
    folder = socket_folder()
    try:
        assert folder.parent == short
    finally:
        folder.rmdir()


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"through-the-tunnel"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_sandboxed_session_under_a_deep_tmpdir_reaches_its_gateway(deep_tmpdir, tmp_path):
    try:
        get_sandbox("bwrap").check()
    except Exception as exc:  # the machine cannot make a sandbox: the reason is the skip
        pytest.skip(str(exc))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tasks = tmp_path / "t.jsonl"
        task = {"task_id": "t", "prompt": "p", "eval": "grep -q through-the-tunnel got.txt"}
        tasks.write_text(json.dumps(task) + "\n")
        argv = [sys.executable, "-m", "polar_mitm", "rollout", str(tasks), "-g", "1"]
        argv += ["--sandbox", "bwrap", "--harness", "cmd:curl -sf {base_url} > got.txt"]
        argv += ["--gateway-url", f"http://127.0.0.1:{server.server_port}"]
        argv += ["--work-dir", str(tmp_path / "run")]
        argv += ["--out", str(tmp_path / "flows"), "--rewards", str(tmp_path / "rewards.jsonl")]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(deep_tmpdir)}
        )
    finally:
        server.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "rewards.jsonl").read_text().splitlines()]
    assert [(r["status"], r["reward"]) for r in rows] == [("ok", 1.0)], (rows, done.stderr[-2000:])


def test_closing_the_tunnel_under_an_open_connection_logs_no_traceback(tmp_path):
    """A harness that keeps its connection open as its session ends (a keep-alive, a stream) has its pipe cancelled
    by the tunnel's close. That is the tunnel's own shutdown, not an error: Python 3.11's unix server used to log it
    as "Exception in callback … CancelledError" with a traceback in the rollout's log (seen in the capstone run)."""
    import asyncio
    import logging

    from polar_mitm.sandbox.tunnel import GatewayTunnel, socket_name

    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append  # type: ignore[method-assign]
    logging.getLogger("asyncio").addHandler(handler)

    async def hold_a_connection_open() -> None:
        upstream = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never answers
        port = upstream.sockets[0].getsockname()[1]
        async with GatewayTunnel([port]) as tunnel:
            reader, writer = await asyncio.open_unix_connection(str(tunnel.folder / socket_name(port)))
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)  # the pipe is running: the tunnel closes under it
        await asyncio.sleep(0.2)  # the cancelled handler's callbacks run
        writer.close()
        upstream.close()

    try:
        asyncio.run(hold_a_connection_open())
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert not [r for r in logged if r.levelno >= logging.ERROR], [r.getMessage() for r in logged]
