"""README's usage line, run as a new user would after the capture quick-start (issue 12, item 5):

    mitmdump -s addon/polar.py --listen-host 127.0.0.1 --set polar_out=flows   # openai SDK through HTTPS_PROXY
    polar-mitm merge flows/                                                       # no --eot-token / --tokenizer
    polar-mitm grpo --data merged/                                                # default output dir

The engine is the plain tiny model: its random samples run into the completion budget, so no record stops on its
own — merge cannot guess the end-of-turn token from the records and must use what the gateway recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_mitm.engines import keys as engine_keys
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.gateway.exposure import exposure_warning
from polar_mitm.processes import children, ports
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.engine_info import ENGINE_FILE
from polar_mitm.storage.records import read_all

BIN = Path(sys.executable).parent
WARNING = "listening beyond loopback without proxyauth"


def start_mitmdump(cwd: Path, engine_url: str, port: int, *extra: str) -> subprocess.Popen:
    """The README's capture command (plus where to find the engine and a private confdir)."""
    cmd = [
        str(BIN / "mitmdump"),
        "-s",
        str(gateway_processes.addon_path()),
        *extra,
        "--listen-port",
        str(port),
        "--set",
        "polar_out=flows",
        "--set",
        f"polar_backend={engine_url}",
        "--set",
        f"confdir={cwd / 'conf'}",
    ]
    # A gateway started by hand finds the engine's key in $POLAR_ENGINE_KEY (polar_mitm/engines/keys.py).
    env = {**os.environ, engine_keys.KEY_ENV: engine_keys.key_for(engine_url) or ""}
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(what)


def chat_through_proxy(port: int, ca_bundle: Path, task: str, session: str) -> None:
    """One openai-SDK call through HTTPS_PROXY to api.openai.com; the proxy user name carries task/session."""
    import ssl

    import httpx
    from openai import OpenAI

    proxy = SessionId(session, task).proxy_url(f"127.0.0.1:{port}")
    http_client = httpx.Client(
        proxy=proxy, verify=ssl.create_default_context(cafile=str(ca_bundle)), timeout=120
    )
    client = OpenAI(api_key="sk-usage-test", http_client=http_client)
    answer = client.chat.completions.create(
        model="gpt-4o-mini", max_tokens=12, messages=[{"role": "user", "content": "Say hi."}]
    )
    assert answer.choices[0].finish_reason == "length"  # the random model never stops on its own


def polar(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "polar-mitm"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.slow
def test_capture_then_merge_and_grpo_work_as_written(tmp_path, engine_url):
    port = ports.free_port()
    gateway = start_mitmdump(tmp_path, engine_url, port, "--listen-host", "127.0.0.1")
    try:
        ports.wait_port(port, timeout=60, proc=gateway)
        wait_for(lambda: (tmp_path / "conf" / "mitmproxy-ca-cert.pem").exists(), 30, "mitmproxy CA")
        bundle = gateway_processes.write_ca_bundle(
            tmp_path / "conf" / "mitmproxy-ca-cert.pem", tmp_path / "ca-bundle.pem"
        )
        for session in ("s-1", "s-2"):
            chat_through_proxy(port, bundle, "greet", session)
        wait_for(
            lambda: "eot_token_id" in json.loads((tmp_path / "flows" / ENGINE_FILE).read_text() or "{}"),
            60,
            "the gateway's engine description",
        )
    finally:
        children.stop(gateway, timeout=30)
        output = gateway.stdout.read() if gateway.stdout else ""
    assert WARNING not in output  # bound to loopback: no exposure warning
    rows = read_all(tmp_path / "flows").to_pylist()
    assert len(rows) == 2 and {r["finish_reason"] for r in rows} == {"length"}
    engine = json.loads((tmp_path / "flows" / ENGINE_FILE).read_text())
    assert (
        engine["eot_token_id"] == 151645 and Path(engine["tokenizer_path"]).is_dir()
    )  # <|im_end|> of Qwen's

    merged = polar(tmp_path, "merge", "flows/")
    assert merged.returncode == 0, merged.stdout + merged.stderr
    summary = json.loads((tmp_path / "merged" / "_summary.json").read_text())
    assert summary["eot_token_id"] == 151645 and ENGINE_FILE in summary["eot_source"]
    assert summary["sequences"] == 2

    (tmp_path / "rewards.jsonl").write_text(
        '{"session_id": "s-1", "reward": 1}\n{"session_id": "s-2", "reward": 0}\n'
    )
    rewarded = polar(
        tmp_path, "merge", "flows/", "--rewards", "rewards.jsonl", "--overwrite"
    )  # (else refused)
    assert rewarded.returncode == 0, rewarded.stdout + rewarded.stderr
    trained = polar(tmp_path, "grpo", "--data", "merged/")
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert (tmp_path / "runs" / "grpo" / "model.safetensors").exists()
    assert "runs/grpo" in trained.stdout  # it says where the checkpoint went
    # No --learning-rate: the tiny model's default, said (it was 1e-6 for every model, silently)
    assert "learning rate 0.005, the default for the tiny model" in trained.stdout
    assert json.loads((tmp_path / "runs" / "grpo" / "grpo_config.json").read_text())["learning_rate"] == 5e-3


def test_merge_flags_still_override_the_recorded_engine(tmp_path):
    """--eot-token wins over `_engine.json` (and a stale sidecar never decides when a flag is given)."""
    from polar_mitm.reconstruct.merge import recorded_eot, resolve_eot

    (tmp_path / ENGINE_FILE).write_text(json.dumps({"eot_token_id": 7, "tokenizer_path": "/nowhere"}))
    assert recorded_eot([str(tmp_path)]) == (7, f"{tmp_path}/{ENGINE_FILE}")
    assert resolve_eot("151645", None, [], [str(tmp_path)]) == (151645, "--eot-token")
    other = tmp_path / "other"
    other.mkdir()
    (other / ENGINE_FILE).write_text(json.dumps({"eot_token_id": 8}))
    with pytest.raises(ValueError, match="different end-of-turn ids"):
        recorded_eot([str(tmp_path), str(other)])


@pytest.mark.parametrize(
    ("modes", "host", "proxyauth", "warns"),
    [
        (["regular"], "", None, True),  # mitmproxy's default: every interface
        (["regular"], "0.0.0.0", None, True),
        (["regular"], "127.0.0.1", None, False),
        (["regular"], "::1", None, False),
        (["regular"], "localhost", None, False),
        (["regular"], "", "user:secret", False),  # a password is asked: the user means it
        (["regular@8080", "reverse:http://127.0.0.1:9@127.0.0.1:8081"], "", None, True),  # one listener open
        (["reverse:http://127.0.0.1:9@127.0.0.1:8081"], "", None, False),  # bound in the mode spec
    ],
)
def test_exposure_warning_names_listeners_beyond_loopback(modes, host, proxyauth, warns):
    assert (exposure_warning(modes, host, proxyauth) is not None) is warns


def test_mitmdump_warns_at_start_when_listening_on_all_interfaces(tmp_path):
    port = ports.free_port()
    # No engine behind it: the warning is about the listener, printed before any call.
    gateway = start_mitmdump(tmp_path, f"http://127.0.0.1:{ports.free_port()}", port)
    lines: list[str] = []
    try:
        ports.wait_port(port, timeout=60, proc=gateway)
        assert gateway.stdout is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(WARNING in line for line in lines):
            lines.append(gateway.stdout.readline())
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
    assert any(WARNING in line and f"all interfaces:{port}" in line for line in lines), lines
