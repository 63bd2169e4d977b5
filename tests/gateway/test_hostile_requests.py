"""Gateway hardening (issue 18, request path): each test reproduces one reported failure through the real gateway.

Real parts throughout: `mitmdump -s addon/polar.py` processes, the embedded engine, official SDKs or raw HTTP for
inputs an SDK would never send, and a real `-w` flow file read back with `mitmproxy.io`. Where an engine must
answer something malformed, a small HTTP server in this file plays the engine (it is not our component).
"""

from __future__ import annotations

import gzip
import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import zstandard
from google import genai
from google.genai import types as gtypes
from mitmproxy import io as mitm_io

from polar_mitm.gateway import identity as ident
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import read_all

SECRET = "sk-hardening-SECRET-5d1e"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
GENERATE = "/v1beta/models/gemini-2.5-flash:generateContent"
COUNT_TOKENS = "/v1/messages/count_tokens"
# Every credential a client may send, written out here (not read from identity's lists) so that a name dropped
# there fails here; identity's lists are added in case they grow.
SECRET_HEADERS = sorted(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "x-goog-api-key",
        "api-key",
        "openai-api-key",
        "anthropic-api-key",
        "x-stainless-api-key",
        "cookie",
    }
    | ident.SECRET_HEADERS
)
SECRET_QUERY_KEYS = sorted({"key", "api_key", "apikey", "access_token"} | ident.SECRET_QUERY_KEYS)


# ---- a fake engine that can answer nonsense ----------------------------------------------------------------


def good_choice() -> dict[str, Any]:
    """A well-formed SGLang chat choice: 3 prompt ids, 2 sampled ids with their logprobs."""
    return {
        "index": 0,
        "message": {"role": "assistant", "content": "ok"},
        "finish_reason": "stop",
        "prompt_token_ids": [1, 2, 3],
        "response_token_ids": [5, 6],
        "logprobs": {"content": [{"token": "o", "logprob": -0.1}, {"token": "k", "logprob": -0.2}]},
    }


def bad_choice(variant: str) -> dict[str, Any]:
    """One malformed engine answer per variant (the variant is named by the request's user text)."""
    choice = good_choice()
    lp = choice["logprobs"]["content"]
    match variant:
        case "id_float":
            choice["response_token_ids"] = [5, 6.5]
        case "id_huge":
            choice["response_token_ids"] = [5, 2**31]
        case "id_negative":
            choice["prompt_token_ids"] = [1, -2, 3]
        case "id_string":
            choice["prompt_token_ids"] = [1, "2", 3]
        case "id_bool":
            choice["response_token_ids"] = [5, True]
        case "logprob_positive":
            lp[1]["logprob"] = 0.5
        case "logprob_nan":
            lp[1]["logprob"] = "NaN"
        case "logprob_string":
            lp[1]["logprob"] = "-0.2"
        case "length_mismatch":
            lp.pop()
        case "model_number":
            return {"model": 7, **choice}
        case "content_number":
            choice["message"]["content"] = 12
        case "ids_not_list":
            choice["response_token_ids"] = {"a": 1}
    return choice


BAD_VARIANTS = [
    "id_float",
    "id_huge",
    "id_negative",
    "id_string",
    "id_bool",
    "logprob_positive",
    "logprob_nan",
    "logprob_string",
    "length_mismatch",
    "model_number",
    "content_number",
    "ids_not_list",
]


class FakeEngine(BaseHTTPRequestHandler):
    """Answers like SGLang, except where the request's last user text names a malformed variant."""

    received: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def _answer(self, payload: Any) -> None:
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        self._answer({"object": "list", "data": [{"id": "fake"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        FakeEngine.received.append(body)
        if self.path == "/tokenize":
            self._answer({"tokens": [1, 2, 3]})  # no `count`: the answer a broken engine gives
            return
        text = body["messages"][-1]["content"]
        choice = bad_choice(text.removeprefix("bad:")) if text.startswith("bad:") else good_choice()
        answer = {"id": "chatcmpl-fake", "object": "chat.completion", "model": "fake", "choices": [choice]}
        if "model" in choice:
            answer["model"] = choice.pop("model")
        raw = json.dumps(answer).replace('"NaN"', "NaN").encode()  # orjson reads a bare NaN as null/error
        self._answer(raw)


@pytest.fixture(scope="module")
def fake_engine_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def start_gateway(backend: str, root: Path, **options: str) -> gateway_processes.GatewayProcess:
    """A real mitmdump gateway writing records under root/flows and every flow to root/flows.mitm (`-w`)."""
    options = {"save_stream_file": str(root / "flows.mitm"), **options}
    return gateway_processes.start_gateway(
        backend, root / "flows", confdir=root / "conf", log=root / "gw.log", options=options
    )


@pytest.fixture(scope="module")
def fake_gw(fake_engine_url, tmp_path_factory) -> Iterator[gateway_processes.GatewayProcess]:
    gw = start_gateway(fake_engine_url, tmp_path_factory.mktemp("fake-gw"))
    yield gw
    gw.stop()


def session_rows(out_dir: Path, session: str, *, include_journal: bool = True) -> list[dict[str, Any]]:
    rows = read_all(out_dir, include_journal=include_journal).to_pylist()
    return sorted((r for r in rows if r["session_id"] == session), key=lambda r: r["seq"])


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt", "messages": [{"role": "user", "content": text}], **extra}


def nested_schema(depth: int) -> dict[str, Any]:
    """A JSON schema nested `depth` objects deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


# ---- item 2: malformed engine answers ----------------------------------------------------------------------


def test_malformed_engine_answers_are_502_and_never_break_compaction(fake_engine_url, tmp_path):
    gw = start_gateway(fake_engine_url, tmp_path)
    session = f"bad-{uuid.uuid4().hex[:6]}"
    try:
        for variant in BAD_VARIANTS:
            r = httpx.post(
                SessionId(session).base_url(gw.reverse_url, CHAT),
                json=chat_body(f"bad:{variant}"),
                timeout=30,
            )
            assert r.status_code == 502, (variant, r.text)
            assert r.json()["error"]["code"] == "engine_error", variant
        client = anthropic.Anthropic(
            api_key=SECRET, base_url=SessionId(session).base_url(gw.reverse_url), max_retries=0
        )
        with pytest.raises(anthropic.APIStatusError) as raised:
            client.messages.create(
                model="claude", max_tokens=8, messages=[{"role": "user", "content": "bad:id_huge"}]
            )
        assert raised.value.status_code == 500 and raised.value.body["error"]["type"] == "api_error"
        ok = httpx.post(SessionId(session).base_url(gw.reverse_url, CHAT), json=chat_body("fine"), timeout=30)
        assert ok.status_code == 200
    finally:
        gw.stop()  # a clean stop compacts the journal into a Parquet shard: every row must convert
    rows = session_rows(gw.out_dir, session, include_journal=False)
    assert len(rows) == len(BAD_VARIANTS) + 2
    assert [r["finish_reason"] for r in rows[:-1]] == ["error"] * (len(BAD_VARIANTS) + 1)
    assert all(not r["completion_ids"] and r["error"].startswith("engine_error") for r in rows[:-1])
    assert rows[-1]["finish_reason"] == "stop" and rows[-1]["completion_ids"] == [5, 6]
    # The gateway starts again over these shards (a bad row once made it refuse to start).
    gw2 = start_gateway(fake_engine_url, tmp_path)
    try:
        assert httpx.post(
            SessionId(session).base_url(gw2.reverse_url, CHAT), json=chat_body("again"), timeout=30
        ).is_success
    finally:
        gw2.stop()


# ---- item 5: secrets scrubbed first, internal errors in the provider's shape -------------------------------


def test_secrets_never_reach_the_flow_file_and_odd_failures_are_provider_shaped(fake_engine_url, tmp_path):
    gw = start_gateway(fake_engine_url, tmp_path)
    base = gw.reverse_url
    try:
        # A non-UTF-8 byte in User-Agent and in x-polar-session: answered normally, recorded.
        r = httpx.post(
            f"{base}{MESSAGES}",
            json={"model": "c", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            headers={
                "x-api-key": SECRET,
                "user-agent": b"agent/1.0 \xff\xfe",
                "x-polar-session": b"sess-\xffodd",
            },
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["type"] == "message", r.text
        # Every secret query key and header, on a model call (no Basic proxy credential: it would name the
        # session, which is recorded).
        query = "&".join(f"{key}={SECRET}" for key in SECRET_QUERY_KEYS)
        r = httpx.post(
            SessionId("secrets").base_url(base, f"{CHAT}?{query}"),
            json=chat_body("hi"),
            headers=dict.fromkeys(SECRET_HEADERS, f"Bearer {SECRET}"),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        # count_tokens with a schema nested deeper than any JSON encoder allows: a client error.
        deep = {
            "model": "c",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "t", "input_schema": nested_schema(300)}],
        }
        r = httpx.post(
            SessionId("secrets").base_url(base, COUNT_TOKENS),
            json=deep,
            headers={"x-api-key": SECRET},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        # count_tokens when the engine's /tokenize answer lacks `count`: an engine error, in Anthropic's shape.
        r = httpx.post(
            SessionId("secrets").base_url(base, f"{COUNT_TOKENS}?key={SECRET}"),
            json={"model": "c", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": SECRET, "anthropic-version": "2023-06-01"},
            timeout=30,
        )
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error", r.text
    finally:
        gw.stop()
    odd = [r for r in read_all(gw.out_dir).to_pylist() if r["session_id"].startswith("sess-")]
    assert len(odd) == 1 and odd[0]["finish_reason"] == "stop" and "agent/1.0" in odd[0]["harness_ids_json"]
    rows = session_rows(gw.out_dir, "secrets")
    assert [r["status_code"] for r in rows] == [200, 400, 500]
    assert rows[2]["finish_reason"] == "error" and "count" in rows[2]["error"]
    raw = (tmp_path / "flows.mitm").read_bytes()
    assert SECRET.encode() not in raw
    with open(tmp_path / "flows.mitm", "rb") as f:
        flows = list(mitm_io.FlowReader(f).stream())
    assert len(flows) == 4
    for flow in flows:
        assert not set(SECRET_HEADERS) & {k.lower() for k in flow.request.headers}
        assert not set(SECRET_QUERY_KEYS) & {k.lower() for k in flow.request.query.keys()}


# ---- item 7: a disconnected client cancels its engine call; a default completion cap -----------------------


@pytest.fixture(scope="module")
def engine_gw(engine_url, tmp_path_factory) -> Iterator[gateway_processes.GatewayProcess]:
    """A gateway in front of the free-running tiny engine (it samples until max_tokens)."""
    gw = start_gateway(engine_url, tmp_path_factory.mktemp("engine-gw"))
    yield gw
    gw.stop()


def test_a_disconnected_client_cancels_its_engine_call_and_is_recorded_as_abort(engine_gw):
    session = f"gone-{uuid.uuid4().hex[:6]}"
    url = SessionId(session).base_url(engine_gw.reverse_url, CHAT)
    warm = httpx.post(
        SessionId(f"warm-{session}").base_url(engine_gw.reverse_url, CHAT),
        json=chat_body("hi", max_tokens=2),
        timeout=300,
    )  # one-time costs (tokenizer loads, connection pools) out of the measurement
    assert warm.status_code == 200
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(url, json=chat_body("write a lot", max_tokens=4000), timeout=2)
    started = time.monotonic()
    r = httpx.post(url, json=chat_body("short", max_tokens=4), timeout=300)
    waited = time.monotonic() - started
    assert r.status_code == 200 and waited < 10, f"the next call waited {waited:.1f}s"
    rows = session_rows(engine_gw.out_dir, session)
    assert [r["finish_reason"] for r in rows] == ["abort", "length"]
    assert not rows[0]["completion_ids"] and "disconnected" in rows[0]["error"]


def test_huge_max_tokens_is_capped_by_default(fake_gw):
    FakeEngine.received.clear()
    marker = f"cap-{uuid.uuid4().hex[:6]}"
    for extra in ({"max_tokens": 2**31}, {}):
        r = httpx.post(f"{fake_gw.reverse_url}{CHAT}", json=chat_body(marker, **extra), timeout=30)
        assert r.status_code == 200, r.text
    sent = [b["max_tokens"] for b in FakeEngine.received if b["messages"][-1]["content"] == marker]
    assert sent == [8192, 8192]


# ---- item 8: compressed request bodies ---------------------------------------------------------------------


def test_gzip_and_zstd_request_bodies_are_decoded(fake_gw):
    body = json.dumps(chat_body("compressed")).encode()
    session = f"enc-{uuid.uuid4().hex[:6]}"
    for encoding, data in (("gzip", gzip.compress(body)), ("zstd", zstandard.compress(body))):
        r = httpx.post(
            SessionId(session).base_url(fake_gw.reverse_url, CHAT),
            content=data,
            headers={"content-type": "application/json", "content-encoding": encoding},
            timeout=30,
        )
        assert r.status_code == 200, (encoding, r.text)
    r = httpx.post(
        SessionId(session).base_url(fake_gw.reverse_url, MESSAGES),
        content=b"\x1f\x8bnot gzip at all",
        headers={"content-type": "application/json", "content-encoding": "gzip"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    rows = session_rows(fake_gw.out_dir, session)
    assert [r["status_code"] for r in rows] == [200, 200, 400]
    assert json.loads(rows[0]["request_json"])["messages"][0]["content"] == "compressed"


# ---- item 9: count_tokens bodies of any size ---------------------------------------------------------------


def test_count_tokens_accepts_bodies_over_64_kib(gateway):
    text = "the quick brown fox jumps over the lazy dog " * 2000  # ~88 KB
    base_url = SessionId("count").base_url(gateway.reverse_url)
    client = anthropic.Anthropic(api_key=SECRET, base_url=base_url, max_retries=0)
    count = client.messages.count_tokens(model="claude", messages=[{"role": "user", "content": text}])
    assert count.input_tokens > 10_000
    google = genai.Client(api_key=SECRET, http_options=gtypes.HttpOptions(base_url=base_url))
    assert google.models.count_tokens(model="gemini-2.5-flash", contents=text).total_tokens > 10_000


# ---- item 10: oversized numbers and deep schemas are client errors -----------------------------------------


def deep_tools(path: str) -> dict[str, Any]:
    schema = nested_schema(300)
    if path == MESSAGES:
        return {"tools": [{"name": "t", "input_schema": schema}]}
    if path == GENERATE:
        return {"tools": [{"functionDeclarations": [{"name": "t", "parameters": schema}]}]}
    if path == RESPONSES:
        return {"tools": [{"type": "function", "name": "t", "parameters": schema}]}
    return {"tools": [{"type": "function", "function": {"name": "t", "parameters": schema}}]}


def request_for(path: str, **extra: Any) -> dict[str, Any]:
    if path == MESSAGES:
        return {"model": "c", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **extra}
    if path == GENERATE:
        return {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], **extra}
    if path == RESPONSES:
        return {"model": "gpt", "input": "hi", **extra}
    return chat_body("hi", **extra)


OVERSIZED = [
    pytest.param(CHAT, {"max_tokens": 1e30}, id="chat-max_tokens"),
    pytest.param(CHAT, {"top_k": 1e308}, id="chat-top_k-float"),
    pytest.param(CHAT, {"top_k": 2**40}, id="chat-top_k-int"),
    pytest.param(RESPONSES, {"max_output_tokens": 1e30}, id="responses-max_output_tokens"),
    pytest.param(RESPONSES, {"top_k": 1e308}, id="responses-top_k"),
    pytest.param(MESSAGES, {"top_k": 2**40}, id="anthropic-top_k"),
    pytest.param(MESSAGES, {"max_tokens": 2**64 - 1}, id="anthropic-max_tokens"),
    pytest.param(GENERATE, {"generationConfig": {"maxOutputTokens": 1e30}}, id="google-maxOutputTokens"),
    pytest.param(GENERATE, {"generationConfig": {"topK": 1e308}}, id="google-topK"),
    pytest.param(
        GENERATE,
        {"generationConfig": {"thinkingConfig": {"thinkingBudget": 1e300}}},
        id="google-thinkingBudget",
    ),
    *[
        pytest.param(path, deep_tools(path), id=f"{name}-schema-300-deep")
        for name, path in (
            ("chat", CHAT),
            ("responses", RESPONSES),
            ("anthropic", MESSAGES),
            ("google", GENERATE),
        )
    ],
]


@pytest.mark.parametrize(("path", "extra"), OVERSIZED)
def test_oversized_numbers_and_deep_schemas_are_provider_shaped_400(fake_gw, path, extra):
    r = httpx.post(
        SessionId("oversized").base_url(fake_gw.reverse_url, path),
        json=request_for(path, **extra),
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        error.get("type") in ("invalid_request_error", None)
        and error.get("status", "INVALID_ARGUMENT") == "INVALID_ARGUMENT"
    )
    assert "Traceback" not in r.text and "internal" not in r.text


# ---- item 11: a request body size limit --------------------------------------------------------------------


def test_bodies_over_the_size_limit_get_a_provider_shaped_413(fake_engine_url, tmp_path):
    gw = start_gateway(fake_engine_url, tmp_path, polar_max_body_mb="1")
    big = json.dumps(request_for(MESSAGES, system="x" * (2 << 20))).encode()
    try:
        r = httpx.post(
            SessionId("big").base_url(gw.reverse_url, MESSAGES),
            content=big,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
        bomb = gzip.compress(big)  # ~2 KB on the wire, 2 MB decoded
        r = httpx.post(
            SessionId("big").base_url(gw.reverse_url, CHAT),
            content=bomb,
            headers={"content-type": "application/json", "content-encoding": "gzip"},
            timeout=60,
        )
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error", r.text
        r = httpx.post(SessionId("big").base_url(gw.reverse_url, CHAT), json=chat_body("small"), timeout=60)
        assert r.status_code == 200
    finally:
        gw.stop()
    assert [r["status_code"] for r in session_rows(gw.out_dir, "big")] == [413, 413, 200]
