"""Option values that would break serving or corrupt records are refused (issue 36 item 12), at start and through
a control call alike; control calls are handled before any body limit; and a control call cannot weaken the
gateway (open passthrough, turn fsync off) or move its records unless it was started allowing that (item 1).

Before: `polar_temperature=inf` sampled near-uniform logprobs, `polar_top_p=2` made every call 400,
`polar_backend=file:///…` every call 503, `polar_max_body_mb=0` everything 413 (and later control calls 404), and
a control call with the token could set `polar_passthrough=upstream` and `polar_fsync=false`.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.gateway.control import CONTROL_PATH, TOKEN_HEADER
from polar_mitm.processes import ports
from polar_mitm.storage.records import read_all

MITMDUMP = str(Path(sys.executable).with_name("mitmdump"))

BAD_VALUES = [
    ("polar_temperature", "inf"),
    ("polar_top_p", "2"),
    ("polar_top_p", "0"),
    ("polar_backend", "file:///tmp/engine"),
    ("polar_backend", "http://[::1"),
    ("polar_backend", "http://"),
    ("polar_max_body_mb", "0"),
    ("polar_out", ""),
    ("polar_out", "records\nfolder"),
    ("polar_out", "a=b"),
    ("polar_rotate_seconds", "0"),
    ("polar_rotate_mb", "0"),
    ("polar_keepalive_seconds", "0.0001"),
    ("polar_engine_timeout", "0"),
]
IDS = [f"{name}={value!r}" for name, value in BAD_VALUES]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=IDS)
def test_a_bad_value_at_start_stops_the_gateway_with_one_line_naming_it(tmp_path, name, value):
    port = ports.free_port()
    cmd = [
        MITMDUMP,
        "-q",
        "-s",
        str(gateway_processes.addon_path()),
        "--listen-host",
        "127.0.0.1",
        "-p",
        str(port),
    ]
    settings = {
        "confdir": tmp_path / "conf",
        "polar_backend": "http://127.0.0.1:9",
        "polar_out": tmp_path / "flows",
    }
    settings[name] = value  # each option once: one given twice is refused for that reason alone
    for setting in settings.items():
        cmd += ["--set", "=".join(map(str, setting))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("polar-mitm: ") and name in lines[0], lines


# ---- through control calls, on a real gateway ---------------------------------------------------------------


def start(engine_url: str, root: Path, **options: str) -> gateway_processes.GatewayProcess:
    root.mkdir(parents=True, exist_ok=True)
    return gateway_processes.start_gateway(
        engine_url, root / "a", confdir=root / "conf", log=root / "gateway.log", options=options
    )


@pytest.fixture(scope="module")
def gateway(engine_url, tmp_path_factory) -> Iterator[gateway_processes.GatewayProcess]:
    gw = start(engine_url, tmp_path_factory.mktemp("ranges"), polar_max_body_mb="1")
    yield gw
    gw.stop()


def control(gw: gateway_processes.GatewayProcess, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    return httpx.post(
        f"{gw.reverse_url}{CONTROL_PATH}",
        content=content,
        headers={TOKEN_HEADER: gw.control_token, "content-type": "application/json"},
        trust_env=False,
        timeout=120,
    )


def chat(gw: gateway_processes.GatewayProcess, session: str) -> None:
    client = OpenAI(base_url=f"{gw.reverse_url}/s/{session}/v1", api_key="x", max_retries=0, timeout=60)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def temperatures(gw: gateway_processes.GatewayProcess, session: str) -> list[float]:
    rows = read_all(gw.out_dir).to_pylist()
    return [r["temperature"] for r in sorted(rows, key=lambda r: r["seq"]) if r["session_id"] == session]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=IDS)
def test_a_bad_value_through_control_is_refused_and_the_old_one_kept(gateway, name, value):
    # Refused whole: a good value sent with the bad one is not applied either.
    companion = {} if name == "polar_temperature" else {"polar_temperature": "0.5"}
    answer = control(gateway, {"options": {**companion, name: value}})
    assert answer.status_code == 400 and name in answer.text, answer.text
    session = f"kept-{abs(hash((name, value)))}"
    chat(gateway, session)  # still served, into the same folder, with nothing of the refused call applied
    assert temperatures(gateway, session) == [1.0]


def test_a_control_call_is_handled_whatever_the_body_limit(gateway):
    """The control body is larger than polar_max_body_mb=1: before, it went down the model-call path (413/404)."""
    padded = b'{"options": {"polar_temperature": "0.25"}, "padding": "' + b" " * (2 << 20) + b'"}'
    answer = control(gateway, padded)
    assert answer.status_code == 200, answer.text
    chat(gateway, "limit")
    assert temperatures(gateway, "limit") == [0.25]
    assert control(gateway, {"options": {"polar_temperature": ""}}).status_code == 200


WEAKENING = [
    {"polar_passthrough": "upstream"},
    {"polar_fsync": False},
    {"polar_fsync": "toggle"},
    {"polar_control_may_weaken": True},
    {"polar_control_may_move_out": False},
]


@pytest.mark.parametrize("options", WEAKENING, ids=[str(o) for o in WEAKENING])
def test_a_control_call_that_would_weaken_the_gateway_is_refused(gateway, options):
    answer = control(gateway, {"options": options})
    assert answer.status_code == 403, answer.text
    assert "refused" in answer.text and next(iter(options)) in answer.text, answer.text
    chat(gateway, "weaken")  # still served and recorded (fsync on, passthrough blocked: see the next test)


def test_weakening_and_moving_need_the_gateway_started_allowing_them(engine_url, tmp_path):
    allowed = start(engine_url, tmp_path / "allowed", polar_control_may_weaken="true")
    fixed = start(engine_url, tmp_path / "fixed", polar_control_may_move_out="false")
    try:
        assert control(allowed, {"options": {"polar_passthrough": "upstream"}}).status_code == 200
        assert control(allowed, {"options": {"polar_fsync": False}}).status_code == 200
        answer = control(fixed, {"options": {"polar_out": str(tmp_path / "elsewhere")}})
        assert answer.status_code == 403 and "polar_control_may_move_out" in answer.text, answer.text
        assert not (tmp_path / "elsewhere").exists()
        assert (
            control(
                fixed, {"options": {"polar_out": str(fixed.out_dir), "polar_temperature": "0.5"}}
            ).status_code
            == 200
        )
        fixed.switch(fixed.out_dir)  # what the loop sends: the same folder stays allowed
    finally:
        allowed.stop()
        fixed.stop()
