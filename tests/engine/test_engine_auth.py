"""The embedded engine's API key (issue 36 item 2) and the weight version of a call a push overtakes (item 11).

Real processes only: `polar-mitm serve` started by `engine_processes.start_engine` (which hands it a key
through a pipe), a real gateway in front of it, and `/proc` read as any process of the same user would read
it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines import weights
from polar_mitm.engines.dialects.base import EngineSyncError
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import children, ports
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import read_all

pytestmark = pytest.mark.slow

# Long enough (about 50 tokens, 15 s at 0.3 s a token) that a push started at the first token has loaded its weights
# before the call ends (the swap itself waits for the generation to finish).
SCRIPT = [
    "Done: out.txt now says hello, and the file is written. I checked it twice: the first line is the greeting, "
    "the second line is empty, and nothing else was changed in the folder or in any other file of the project."
]
EVERY_ROUTE = [
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "attacker"}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("GET", "/model_info", None),
    ("GET", "/get_model_info", None),
    ("GET", "/engine_stats", None),
    ("GET", "/v1/models", None),
    ("GET", "/health_generate", None),
]


@pytest.fixture(scope="module")
def paced_engine(tmp_path_factory):
    """A scripted tiny engine at 0.3 s a token whose streams do not say their weight version (as SGLang's)."""
    root = tmp_path_factory.mktemp("auth-engine")
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    extra = ["--script", str(script), "--token-delay", "0.3", "--no-stream-weight-version"]
    proc, url = engine_processes.start_engine("tiny", log=root / "engine.log", extra_args=extra)
    yield url
    children.stop(proc)


@pytest.fixture(scope="module")
def gateway(paced_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("auth-gateway")
    gw = gateway_processes.start_gateway(
        paced_engine, root / "flows", confdir=root / "conf", log=root / "gateway.log"
    )
    yield gw
    gw.stop()


def _call(url: str, method: str, path: str, body, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers or {}, timeout=60)


def _served_version(url: str) -> str:
    return httpx.get(f"{url}/model_info", headers=engine_keys.auth_headers(url), timeout=30).json()[
        "weight_version"
    ]


def test_every_route_but_health_refuses_a_call_without_the_engine_key(paced_engine):
    assert httpx.get(f"{paced_engine}/health", timeout=10).status_code == 200
    for method, path, body in EVERY_ROUTE:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": "not-bearer"}):
            answer = _call(paced_engine, method, path, body, headers)
            assert answer.status_code == 401, (path, headers, answer.text)
            assert answer.json()["type"] == "AuthenticationError" and "API key" in answer.json()["message"]
    # With the key the same routes answer (the push with a bogus path fails on the path, not on the key).
    assert _call(paced_engine, "GET", "/model_info", None, engine_keys.auth_headers(paced_engine)).is_success
    assert _call(
        paced_engine, "POST", "/tokenize", {"prompt": "hi"}, engine_keys.auth_headers(paced_engine)
    ).is_success


def test_the_engine_key_is_on_no_command_line_or_environment_and_the_gateway_still_serves(
    paced_engine, gateway
):
    session = f"auth-{uuid.uuid4().hex[:6]}"
    url = SessionId(session).base_url(gateway.reverse_url, "/v1/chat/completions")
    body = {"model": "gpt-4.1", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(url, json=body, headers={"authorization": "Bearer sk-test"}, timeout=120)
    assert answer.status_code == 200, answer.text
    key = engine_keys.key_for(paced_engine)
    assert key and len(key) >= 32
    readable = leaked = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        for name in ("cmdline", "environ"):
            try:
                data = (entry / name).read_bytes()
            except OSError:
                continue
            readable += 1
            leaked += key.encode() in data
    assert readable > 4  # the engine, the gateway and this process among them
    assert leaked == 0


def test_a_push_under_a_version_the_engine_served_is_refused(paced_engine, tiny_model_dir):
    headers = engine_keys.auth_headers(paced_engine)
    served = _served_version(paced_engine)
    same = {"model_path": str(tiny_model_dir), "weight_version": served}
    refused = _call(paced_engine, "POST", "/update_weights_from_disk", same, headers)
    assert refused.status_code == 400 and "new label" in refused.json()["message"]
    with pytest.raises(EngineSyncError):
        weights.push_weights(paced_engine, tiny_model_dir, weight_version=served)
    new = f"auth-{uuid.uuid4().hex[:6]}"
    assert weights.push_weights(paced_engine, tiny_model_dir, weight_version=new) == new
    back = {"model_path": str(tiny_model_dir), "weight_version": served}  # an earlier label, reused
    assert _call(paced_engine, "POST", "/update_weights_from_disk", back, headers).status_code == 400
    assert _served_version(paced_engine) == new


def test_a_push_landing_during_a_streamed_call_keeps_the_old_version_on_its_record(
    paced_engine, gateway, tiny_model_dir
):
    """SGLang-like streams say no version: the record is labelled with the version read before the call; before the
    fix it was labelled with the pushed weights' version (read after the answer, once the push had landed).

    A push waits for the running generation (the embedded engine's lock, SGLang's model-update lock), so it lands at
    the call's end, racing the gateway's read after the stream: when the push wins, the record also says the new
    version (`weight_version_after`); when the read wins, it says nothing more. Either way the label is the old
    version, which is what the trainer's staleness needs."""
    before = _served_version(paced_engine)
    pushed = f"during-{uuid.uuid4().hex[:6]}"
    session = f"overlap-{uuid.uuid4().hex[:6]}"
    url = SessionId(session).base_url(gateway.reverse_url, "/v1/chat/completions")
    body = {"model": "gpt-4.1", "stream": True, "messages": [{"role": "user", "content": "write it"}]}
    push: threading.Thread | None = None
    with httpx.stream(
        "POST", url, json=body, headers={"authorization": "Bearer sk-test"}, timeout=120
    ) as resp:
        for line in resp.iter_lines():
            if (
                push is None
                and '"content":"' in line.replace(" ", "")
                and '"content":""' not in line.replace(" ", "")
            ):
                push = threading.Thread(
                    target=weights.push_weights,
                    args=(paced_engine, tiny_model_dir),
                    kwargs={"weight_version": pushed},
                )
                push.start()  # lands while the engine still generates this call
    assert push is not None
    push.join(120)
    assert _served_version(paced_engine) == pushed
    deadline = time.monotonic() + 10
    rows: list[dict] = []
    while not rows and time.monotonic() < deadline:
        rows = [r for r in read_all(gateway.out_dir).to_pylist() if r["session_id"] == session]
        time.sleep(0.1)
    assert len(rows) == 1 and rows[0]["error"] is None
    assert rows[0]["weight_version"] == before
    meta = json.loads(rows[0]["engine_meta_json"])
    if "weight_version_after" in meta:  # the push landed before the gateway's read after the stream
        assert meta["weight_version_after"] == pushed and meta["weight_version_changed"] is True
    else:
        assert "weight_version_changed" not in meta


def test_a_version_read_before_and_after_a_call_says_a_change_only_when_there_was_one():
    """What the record says when the two reads differ (`version_change` of engines/dialects/base.py, used by both
    paths)."""
    from polar_mitm.engines.dialects.base import version_change

    assert version_change("3", "4") == {"weight_version_after": "4", "weight_version_changed": True}
    assert (
        version_change("3", "3") == {}
        and version_change("3", None) == {}
        and version_change(None, None) == {}
    )


def test_an_engine_without_a_key_samples_but_takes_no_push(tmp_path, tiny_model_dir):
    port = ports.free_port()
    env = {k: v for k, v in os.environ.items() if k not in (engine_keys.KEY_ENV, "POLAR_SECRETS_FD")}
    cmd = [sys.executable, "-m", "polar_mitm.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        ports.wait_http(f"{url}/health", proc=proc)
        assert _call(url, "POST", "/tokenize", {"prompt": "hi"}).is_success
        for method, path, body in EVERY_ROUTE:
            if path in ("/update_weights_from_disk", "/abort_request", "/engine_stats"):
                answer = _call(url, method, path, body)
                assert answer.status_code == 403 and "--api-key-file" in answer.json()["message"]
    finally:
        children.stop(proc)


def test_serve_refuses_a_key_file_others_can_read_in_one_line(tmp_path):
    key_file = tmp_path / "engine.key"
    key_file.write_text("k" * 40)
    key_file.chmod(0o644)
    for given in (key_file, tmp_path / "missing.key"):
        cmd = [sys.executable, "-m", "polar_mitm.cli", "serve", "--api-key-file", str(given)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        assert len(lines) == 1 and "--api-key-file" in lines[0] and "Traceback" not in lines[0]
