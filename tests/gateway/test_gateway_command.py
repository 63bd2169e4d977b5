"""`polar-mitm gateway` (issue 38): the real command, a real engine, and harness-side clients hooked up with exactly
the variables it prints — the official openai and anthropic SDKs in base-URL mode, the openai SDK through the
printed HTTPS_PROXY and CA bundle — then stopped with SIGINT, and the records it wrote read back.
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from polar_mitm.engines import keys as engine_keys
from polar_mitm.harness.base import PROXY_VARS
from polar_mitm.processes import ports
from polar_mitm.storage.records import read_all

BIN = Path(sys.executable).parent
READY_LINE = "Ctrl-C stops it"
# Variables of the test process that would point a client elsewhere than the printed hook-up says.
CLIENT_VARS = (
    *PROXY_VARS,
    "NO_PROXY",
    "no_proxy",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "OPENAI_BASE_URL",
    "ANTHROPIC_BASE_URL",
    "GOOGLE_GEMINI_BASE_URL",
)


class Gateway:
    """`polar-mitm gateway ARGS` as a child process, its stdout read line by line as it comes."""

    def __init__(self, cwd: Path, *args: str, engine_key: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in CLIENT_VARS}
        env["HF_HUB_OFFLINE"] = "1"
        env["TMPDIR"] = str(cwd)  # where the embedded engine's log is kept
        if (
            engine_key
        ):  # an engine started elsewhere: its key, as a user gives it (polar_mitm/engines/keys.py)
            env[engine_keys.KEY_ENV] = engine_key
        self.proc = subprocess.Popen(
            [str(BIN / "polar-mitm"), "gateway", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def printed_until_ready(self, timeout: float = 180.0) -> list[str]:
        """What it printed up to the line that says it serves (fails with its stderr if it exits first)."""
        printed, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait()
                raise AssertionError(f"exited with {self.proc.returncode}: {self.proc.stderr.read()}")
            printed.append(line)
            if line.startswith(READY_LINE):
                return printed
        raise AssertionError(f"not ready in {timeout:.0f}s; printed {printed}")

    def interrupt(self, timeout: float = 60.0) -> tuple[int, str]:
        """SIGINT, as Ctrl-C sends it; (exit code, stderr)."""
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout)
        return code, self.proc.stderr.read() if self.proc.stderr else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def hookups(printed: list[str]) -> dict[str, dict[str, str]]:
    """The variables under each mode's heading: {"proxy": {...}, "base-URL": {...}}."""
    found = {}
    for heading, assignments in zip(printed, printed[1:], strict=False):
        mode = heading.partition(" mode")[0]
        if mode in ("proxy", "base-URL") and heading.startswith(mode):
            found[mode] = dict(word.split("=", 1) for word in shlex.split(assignments))
    return found


def use_only(monkeypatch, env: dict[str, str]) -> None:
    """This process's client environment = exactly `env` (what a harness started with that prefix would have)."""
    for name in CLIENT_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_gateway_prints_both_hookups_that_real_sdks_then_use(engine_url, tmp_path, monkeypatch):
    from anthropic import Anthropic
    from openai import OpenAI

    proxy_port, reverse_port = ports.free_port(), ports.free_port()
    gateway = Gateway(
        tmp_path,
        *("--engine", engine_url, "--out", "flows", "--confdir", "conf"),
        *("--port", str(proxy_port), "--base-url-port", str(reverse_port)),
        *("--set", "polar_max_tokens=6"),  # passed through to mitmdump: every call stops at 6 tokens
        engine_key=engine_keys.key_for(engine_url),
    )
    try:
        printed = gateway.printed_until_ready()
        modes = hookups(printed)
        proxy, base_url = modes["proxy"], modes["base-URL"]
        bundle = tmp_path / "conf" / "ca-bundle.pem"
        assert proxy["HTTPS_PROXY"] == f"http://127.0.0.1:{proxy_port}"
        # The variables the harness presets set in proxy mode (harness/base.py), for every runtime.
        assert {name for name in proxy if name.endswith("PROXY") or name.endswith("proxy")} >= set(PROXY_VARS)
        for name in ("SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "REQUESTS_CA_BUNDLE"):
            assert Path(proxy[name]) == bundle.absolute()
        assert b"BEGIN CERTIFICATE" in bundle.read_bytes()  # system CAs + mitmproxy's, written at start
        assert base_url["OPENAI_BASE_URL"] == f"http://127.0.0.1:{reverse_port}/v1"
        assert base_url["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{reverse_port}"

        use_only(monkeypatch, base_url)
        chat = OpenAI(api_key="sk-base-url").chat.completions.create(
            model="gpt-4o-mini", max_tokens=32, messages=[{"role": "user", "content": "Say hi."}]
        )
        message = Anthropic(api_key="sk-ant-base-url").messages.create(
            model="claude-sonnet-4-5", max_tokens=32, messages=[{"role": "user", "content": "Say hi."}]
        )
        use_only(monkeypatch, proxy)
        proxied = OpenAI(api_key="sk-proxy").chat.completions.create(
            model="gpt-4o-mini", max_tokens=32, messages=[{"role": "user", "content": "Say hi."}]
        )
        assert chat.choices[0].finish_reason == proxied.choices[0].finish_reason == "length"
        assert message.stop_reason == "max_tokens"

        code, stderr = gateway.interrupt()
    finally:
        gateway.kill()
    assert code == 0, stderr
    assert refused(proxy_port) and refused(reverse_port)  # mitmdump is gone with the command
    assert list((tmp_path / "flows").glob("records-*.parquet")), "the journal was not compacted at the stop"
    rows = sorted(read_all(tmp_path / "flows").to_pylist(), key=lambda r: r["started_at"])
    assert [(r["provider"], r["mode"]) for r in rows] == [
        ("openai_chat", "reverse"),
        ("anthropic", "reverse"),
        ("openai_chat", "regular"),
    ]
    assert (
        rows[2]["host"] == "api.openai.com"
    )  # the harness kept its provider's host: HTTPS_PROXY interception
    for row in rows:
        assert row["finish_reason"] == "length" and len(row["completion_ids"]) == 6  # the --set cap
        assert row["prompt_ids"] and len(row["completion_logprobs"]) == 6


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--engine", "DEAD"), "--engine DEAD: nothing answers at DEAD/health"),
        (("--set", "polar_out=elsewhere"), "--set polar_out: use --out instead"),
        (("--set", "polar_max_token=5"), "no such gateway option; did you mean polar_max_tokens?"),
        (("--port", "18080", "--base-url-port", "18080"), "--base-url-port 18080: the same as --port"),
    ],
    ids=["dead-engine", "set-of-our-own-option", "misspelt-option", "one-port-for-both"],
)
def test_a_mistake_is_one_line_and_exit_2_before_anything_starts(tmp_path, args, expected):
    dead = f"http://127.0.0.1:{ports.free_port()}"
    args = tuple(dead if a == "DEAD" else a for a in args)
    done = subprocess.run(
        [str(BIN / "polar-mitm"), "gateway", *args, "--out", "flows"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and expected.replace("DEAD", dead) in lines[0], done.stderr
    assert done.stdout == "" and not (tmp_path / "flows").exists()  # nothing started, nothing written


@pytest.mark.slow  # the embedded engine's start: 9 s on a quiet machine, 22 s while other jobs share the cores
def test_without_engine_it_starts_the_embedded_one_and_stops_it(tmp_path, monkeypatch):
    from openai import OpenAI

    proxy_port = ports.free_port()
    gateway = Gateway(tmp_path, "--port", str(proxy_port), "--out", "flows", "--confdir", "conf")
    try:
        printed = gateway.printed_until_ready()
        first = printed[0]
        assert first.startswith("polar-mitm gateway: embedded engine http://127.0.0.1:"), first
        engine_port = int(first.split("http://127.0.0.1:", 1)[1].split(" ", 1)[0])
        base_url = hookups(printed)["base-URL"]
        assert base_url["OPENAI_BASE_URL"] == f"http://127.0.0.1:{proxy_port + 1}/v1"  # default: --port + 1
        use_only(monkeypatch, base_url)
        answer = OpenAI(api_key="sk-embedded").chat.completions.create(
            model="gpt-4o-mini", max_tokens=4, messages=[{"role": "user", "content": "Say hi."}]
        )
        assert answer.choices[0].finish_reason == "length"
        code, stderr = gateway.interrupt()
    finally:
        gateway.kill()
    assert code == 0, stderr
    assert refused(engine_port) and refused(proxy_port)  # the engine it started went down with it
    assert len(read_all(tmp_path / "flows")) == 1
