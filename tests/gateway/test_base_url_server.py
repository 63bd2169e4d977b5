"""Base-URL calls on the gateway's own server (gateway/base_url_server.py) and through mitmproxy's reverse mode: the
same calls give the same answers and the same records, field by field (issue 45 §1).

Two real gateways on one embedded engine: `ours` as `polar-mitm` starts them (`polar_base_url_port`), `mitm` with
`$POLAR_BASE_URL_SERVER=mitmproxy` (`--mode reverse:`). Each call goes to both with the same session, greedy, so
the engine samples the same tokens: a whole and a streamed chat call with tools, a streamed Anthropic call, a
Responses call, a body that is not JSON, one over the body limit, a credential that must not be kept, a models
listing and a control call. Only a record's clocks, request id and engine timings may differ.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from polar_mitm.gateway import control
from polar_mitm.gateway import processes as gateway_processes
from tests.gateway.test_streaming_live import _normalised, _records

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
SECRET = "sk-base-url-secret-123456"
# What may differ between two records of the same call: its clocks, its id, and the engine's timings.
CLOCKS = {"request_id", "started_at", "finished_at"}


@pytest.fixture(scope="module")
def gateways(engine_url, tmp_path_factory) -> Iterator[dict[str, gateway_processes.GatewayProcess]]:
    root = tmp_path_factory.mktemp("base-url")
    options = {"polar_max_body_mb": "1"}
    started: dict[str, gateway_processes.GatewayProcess] = {}
    try:
        for name, server in (("ours", "polar"), ("mitm", "mitmproxy")):
            (root / name).mkdir()
            before = os.environ.get(gateway_processes.BASE_URL_SERVER_ENV)
            os.environ[gateway_processes.BASE_URL_SERVER_ENV] = server
            try:
                started[name] = gateway_processes.start_gateway(
                    engine_url,
                    root / name / "flows",
                    confdir=root / name / "conf",
                    log=root / name / "gateway.log",
                    options=options,
                )
            finally:
                if before is None:
                    os.environ.pop(gateway_processes.BASE_URL_SERVER_ENV)
                else:
                    os.environ[gateway_processes.BASE_URL_SERVER_ENV] = before
        yield started
    finally:
        for gw in started.values():
            gw.stop()


def both(gateways, method: str, path: str, **kwargs) -> dict[str, httpx.Response]:
    """The same request to each gateway's base URL."""
    return {
        name: httpx.request(method, f"{gw.reverse_url}{path}", timeout=120, trust_env=False, **kwargs)
        for name, gw in gateways.items()
    }


def comparable_answer(answer: httpx.Response) -> tuple[int, str, Any]:
    kind = answer.headers.get("content-type", "").split(";")[0]
    if kind == "application/json":
        return answer.status_code, kind, _normalised(answer.json())
    if kind == "text/event-stream":
        events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
        parsed = [_normalised(json.loads(e[6:])) if e[6:].startswith("{") else e for e in events]
        return answer.status_code, kind, parsed
    return answer.status_code, kind, answer.text


def comparable_record(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k not in CLOCKS}
    for key in ("response_json", "messages_json", "request_json"):
        try:
            out[key] = _normalised(json.loads(row[key])) if row[key] else None
        except json.JSONDecodeError:  # what a harness sent that is not JSON is kept as sent
            out[key] = row[key]
    meta = json.loads(row["engine_meta_json"] or "{}")  # the rest of the engine's meta is timing
    out["engine_meta_json"] = {
        k: meta.get(k) for k in ("finish_reason", "prompt_tokens", "completion_tokens")
    }
    out["completion_logprobs"] = [round(x, 5) for x in row["completion_logprobs"] or []]
    return out


CALLS = [
    pytest.param(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "list the files"}], "tools": TOOLS, "max_tokens": 12},
        id="chat-whole-tools",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "stream": True},
        id="chat-streamed",
    ),
    pytest.param(
        "POST",
        "/v1/messages",
        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "stream": True},
        id="anthropic-streamed",
    ),
    pytest.param("POST", "/v1/responses", {"input": "hello", "max_output_tokens": 12}, id="responses"),
    pytest.param("POST", "/v1/chat/completions", b"{not json", id="not-json"),
    pytest.param("POST", "/v1/chat/completions", b"x" * (2 << 20), id="over-the-body-limit"),
]


@pytest.mark.parametrize(("method", "path", "body"), CALLS)
def test_the_same_call_gives_the_same_answer_and_record_through_either_server(gateways, method, path, body):
    session = f"base-{uuid.uuid4().hex[:8]}"
    headers = {
        "authorization": f"Bearer {SECRET}",
        "x-api-key": SECRET,
        "anthropic-version": "2023-06-01",
        "content-type": "application/json",
    }
    if isinstance(body, dict):
        body = json.dumps({"model": "m", "temperature": 0, **body}).encode()
    answers = both(gateways, method, f"/s/{session}{path}", content=body, headers=headers)
    assert comparable_answer(answers["ours"]) == comparable_answer(answers["mitm"])
    records = {name: _records(gw, session) for name, gw in gateways.items()}
    assert records["ours"], f"no record of {path} on our server"
    assert len(records["ours"]) == len(records["mitm"])
    for ours, mitm in zip(records["ours"], records["mitm"], strict=True):
        a, b = comparable_record(ours), comparable_record(mitm)
        differing = sorted(k for k in a if a[k] != b[k])
        assert not differing, {k: (a[k], b[k]) for k in differing}
        assert ours["mode"] == "reverse" and SECRET not in json.dumps(ours, default=str)


def test_models_readiness_and_not_a_model_call_answer_alike(gateways):
    for path in ("/v1/models", gateway_processes.GATEWAY_READY_PATH, "/not/a/model/call"):
        answers = both(gateways, "GET", path)
        ours, mitm = (comparable_answer(answers[n]) for n in ("ours", "mitm"))
        if path == gateway_processes.GATEWAY_READY_PATH:  # says how long ago the gateway loaded
            ours, mitm = ours[:2], mitm[:2]
        assert ours == mitm, path


def test_control_calls_need_the_token_on_our_server_too(gateways):
    gw = gateways["ours"]
    url = f"{gw.reverse_url}{control.CONTROL_PATH}"
    body = {"options": {"polar_temperature": "0.5"}}
    for headers in ({}, {control.TOKEN_HEADER: "guess"}):
        refused = httpx.post(url, json=body, headers=headers, trust_env=False, timeout=30)
        assert refused.status_code == 403 and "refused" in refused.text
    applied = httpx.post(
        url, json=body, headers={control.TOKEN_HEADER: gw.control_token}, trust_env=False, timeout=60
    )
    assert applied.status_code == 200 and applied.json()["applied"] == ["polar_temperature=0.5"]
    reset = {"options": {"polar_temperature": ""}}
    assert httpx.post(
        url, json=reset, headers={control.TOKEN_HEADER: gw.control_token}, trust_env=False, timeout=60
    ).is_success
