"""Gateway failure modes: engine down or overflowing, kill -9 durability, fuzzed bodies, side traffic."""

from __future__ import annotations

import json
import signal
import time
import uuid

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import errors as gerrors
from google.genai import types as gtypes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import ports
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import read_all

KEY = "sk-polar-robust-SECRET"
MODEL_PATHS = {
    "anthropic": "/v1/messages",
    "openai_chat": "/v1/chat/completions",
    "openai_responses": "/v1/responses",
    "google": "/v1beta/models/gemini-2.5-flash:generateContent",
}


@pytest.fixture(scope="module")
def dead_gateway(tmp_path_factory):
    """A gateway whose engine does not exist."""
    root = tmp_path_factory.mktemp("dead")
    gw = gateway_processes.start_gateway(
        f"http://127.0.0.1:{ports.free_port()}", root / "flows", confdir=root / "conf", log=root / "gw.log"
    )
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def small_context_gateway(tmp_path_factory):
    """A gateway in front of an engine whose context is only 64 tokens."""
    root = tmp_path_factory.mktemp("small")
    with gateway_processes.engine_and_gateway(
        root / "flows",
        confdir=root / "conf",
        engine_args=["--context-length", "64"],
        engine_log=root / "engine.log",
        gateway_log=root / "gw.log",
    ) as (_, gw):
        yield gw


def sdk_errors(gw, session):
    """Call each SDK once through `gw` (reverse mode) and return the exception each raised."""
    prefix = SessionId(session).base_url(gw.reverse_url)
    long_text = "word " * 200
    raised = {}
    try:
        anthropic.Anthropic(api_key=KEY, base_url=prefix, max_retries=0).messages.create(
            model="claude", max_tokens=16, messages=[{"role": "user", "content": long_text}]
        )
    except anthropic.APIStatusError as exc:
        raised["anthropic"] = exc
    client = openai.OpenAI(api_key=KEY, base_url=f"{prefix}/v1", max_retries=0)
    try:
        client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": long_text}])
    except openai.APIStatusError as exc:
        raised["openai_chat"] = exc
    try:
        client.responses.create(model="gpt", input=long_text)
    except openai.APIStatusError as exc:
        raised["openai_responses"] = exc
    try:
        google_client = genai.Client(api_key=KEY, http_options=gtypes.HttpOptions(base_url=prefix))
        google_client.models.generate_content(model="gemini-2.5-flash", contents=long_text)
    except gerrors.APIError as exc:
        raised["google"] = exc
    return raised


def test_engine_down_surfaces_as_each_providers_own_error(dead_gateway):
    raised = sdk_errors(dead_gateway, "down")
    assert isinstance(raised["anthropic"], anthropic.OverloadedError)
    assert raised["anthropic"].body["error"]["type"] == "overloaded_error"
    assert isinstance(raised["openai_chat"], openai.InternalServerError)
    assert isinstance(raised["openai_responses"], openai.InternalServerError)
    assert isinstance(raised["google"], gerrors.ServerError) and raised["google"].status == "UNAVAILABLE"
    rows = [r for r in read_all(dead_gateway.out_dir).to_pylist() if r["session_id"] == "down"]
    assert len(rows) == 4 and all(r["finish_reason"] == "error" and r["error"] for r in rows)
    assert httpx.head(dead_gateway.reverse_url + "/").status_code == 200  # still serving


def test_context_overflow_is_a_provider_shaped_400(small_context_gateway):
    raised = sdk_errors(small_context_gateway, "overflow")
    assert isinstance(raised["anthropic"], anthropic.BadRequestError)
    assert raised["anthropic"].body["error"]["type"] == "invalid_request_error"
    assert isinstance(raised["openai_chat"], openai.BadRequestError)
    assert raised["openai_chat"].code == "context_length_exceeded"
    assert isinstance(raised["openai_responses"], openai.BadRequestError)
    assert isinstance(raised["google"], gerrors.ClientError) and raised["google"].status == "INVALID_ARGUMENT"


@pytest.mark.slow
def test_kill_9_amid_concurrent_closes_loses_no_acknowledged_record(scripted_engine_url, tmp_path):
    """Group commit (one fsync for the records that finish together) never acknowledges before durable: calls of
    16 sessions close concurrently, the gateway is killed while others are in flight, and every call a client got
    its answer for has its record."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    out = tmp_path / "flows"
    gw = gateway_processes.start_gateway(scripted_engine_url, out, confdir=tmp_path / "conf")
    acknowledged: set[str] = set()
    enough = threading.Event()
    lock = threading.Lock()

    def call(session: str) -> None:
        base = SessionId(session).base_url(gw.reverse_url, "/v1")
        body = {"model": "gpt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        try:
            answer = httpx.post(
                f"{base}/chat/completions", json=body, headers={"authorization": KEY}, timeout=60
            )
        except httpx.HTTPError:
            return  # in flight when the gateway died: never acknowledged
        if answer.status_code == 200:
            with lock:
                acknowledged.add(session)
                if len(acknowledged) >= 12:
                    enough.set()

    with ThreadPoolExecutor(16) as pool:
        calls = [pool.submit(call, f"closes-{i}") for i in range(64)]
        assert enough.wait(120), "the gateway answered fewer than 12 calls"
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait()
        for future in calls:
            future.result()
    with lock:
        answered = set(acknowledged)
    recorded = {r["session_id"] for r in read_all(out).to_pylist()}
    assert answered <= recorded, f"acknowledged but lost: {sorted(answered - recorded)}"


@pytest.mark.slow
def test_acknowledged_records_survive_kill_9_and_numbering_continues(scripted_engine_url, tmp_path):
    out = tmp_path / "flows"
    gw = gateway_processes.start_gateway(scripted_engine_url, out, confdir=tmp_path / "conf")
    client = openai.OpenAI(
        api_key=KEY, base_url=SessionId("durable").base_url(gw.reverse_url, "/v1"), max_retries=0
    )
    for _ in range(5):
        client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "hi"}])
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait()
    # Nothing was compacted yet: the five answered calls live in the fsynced journal.
    assert not list(out.glob("records-*.parquet"))
    assert len(read_all(out)) == 5
    gw2 = gateway_processes.start_gateway(scripted_engine_url, out, confdir=tmp_path / "conf")
    try:
        # The restart compacted the journal into a readable shard, and seq goes on from 5.
        shards = list(out.glob("records-*.parquet"))
        assert len(shards) == 1 and len(read_all(out, include_journal=False)) == 5
        client = openai.OpenAI(
            api_key=KEY, base_url=SessionId("durable").base_url(gw2.reverse_url, "/v1"), max_retries=0
        )
        client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "again"}])
        seqs = sorted(r["seq"] for r in read_all(out).to_pylist())
        assert seqs == [0, 1, 2, 3, 4, 5]
    finally:
        gw2.stop()
    # A clean stop compacts the live journal too.
    assert len(read_all(out, include_journal=False)) == 6


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
near_valid = st.fixed_dictionaries(
    {
        "model": st.one_of(st.text(max_size=8), st.integers()),
        "max_tokens": st.one_of(st.integers(-5, 50), st.text(max_size=3)),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant", "x"]), "content": json_values}
            ),
            max_size=3,
        ),
        "input": json_values,
        "contents": json_values,
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.one_of(json_values, near_valid), provider=st.sampled_from(list(MODEL_PATHS)), raw=st.booleans()
)
def test_fuzzed_bodies_never_crash_the_gateway(gateway, body, provider, raw):
    payload = json.dumps(body).encode()[:-1] if raw else json.dumps(body).encode()  # raw: broken JSON
    r = httpx.post(
        SessionId("fuzz").base_url(gateway.reverse_url, MODEL_PATHS[provider]),
        content=payload,
        headers={"content-type": "application/json", "x-api-key": KEY},
        timeout=60,
    )
    assert r.status_code in (200, 400) or r.status_code >= 500 and r.status_code != 500, r.text
    assert isinstance(r.json(), dict | list)


def test_side_traffic_gets_prompt_provider_shaped_answers(gateway, proxy_env):
    proxy_env("side")
    a = anthropic.Anthropic(api_key=KEY, max_retries=0)
    count = a.messages.count_tokens(model="claude", messages=[{"role": "user", "content": "hello there"}])
    assert count.input_tokens > 3
    models = openai.OpenAI(api_key=KEY, max_retries=0).models.list()
    assert "tiny" in [m.id for m in models.data]
    g = genai.Client(api_key=KEY)
    assert g.models.count_tokens(model="gemini-2.5-flash", contents="hello there").total_tokens > 3
    assert g.models.get(model="gemini-2.5-flash").name.endswith("gemini-2.5-flash")
    import ssl

    trust = ssl.create_default_context(cafile=str(gateway.ca_bundle()))
    with httpx.Client(proxy=f"http://side:x@127.0.0.1:{gateway.proxy_port}", verify=trust, timeout=10) as c:
        started = time.monotonic()
        r = c.post("https://statsig.anthropic.com/v1/rgstr", json={"events": []})
        assert r.status_code == 404 and time.monotonic() - started < 5
        r = c.get("https://api.anthropic.com/api/oauth/claude_cli/client_data")
        assert r.status_code == 404 and r.json()["type"] == "error"
        r = c.head("https://api.anthropic.com/")
        assert r.status_code == 200


def test_claude_code_billing_line_does_not_change_the_prompt(gateway):
    client = anthropic.Anthropic(
        api_key=KEY, base_url=SessionId("billing").base_url(gateway.reverse_url), max_retries=0
    )
    for cch in ("8f3a1", "77c02"):
        client.messages.create(
            model="claude",
            max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
            system=[
                {
                    "type": "text",
                    "text": f"x-anthropic-billing-header: cc_version=2.0.14; cc_entrypoint=cli; cch={cch};",
                },
                {"type": "text", "text": "You are Claude Code."},
            ],
        )
    rows = sorted(
        (r for r in read_all(gateway.out_dir).to_pylist() if r["session_id"] == "billing"),
        key=lambda r: r["seq"],
    )
    assert len(rows) == 2 and rows[0]["prompt_ids"] == rows[1]["prompt_ids"]
    assert "cch=8f3a1" in rows[0]["request_json"] and "cch=77c02" in rows[1]["request_json"]
    assert "billing" not in rows[0]["messages_json"]


def test_concurrent_sessions_are_never_mixed_up(gateway):
    import concurrent.futures as cf

    def one(i):
        session = f"conc-{i}-{uuid.uuid4().hex[:6]}"
        c = openai.OpenAI(
            api_key=SessionId(session).api_key, base_url=f"{gateway.reverse_url}/v1", max_retries=0
        )
        tools = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]
        out = c.chat.completions.create(
            model="gpt", messages=[{"role": "user", "content": f"n={i}"}], tools=tools
        )
        return session, out.choices[0].message.tool_calls[0].function.name

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(32)))
    rows = {r["session_id"]: r for r in read_all(gateway.out_dir).to_pylist()}
    for i, (session, name) in enumerate(results):
        assert name == "shell"
        row = rows[session]
        assert row["session_source"] == "api_key" and f"n={i}" in row["messages_json"]
