"""Live streaming (issue 13): real engines and gateways, the official SDKs, streamed vs answered-whole.

The scripted tiny engine plays a turn with reasoning, text and a tool call, then a final answer, so every kind of
delta is streamed; its logprobs are the model's own, so records carry real numbers. Each check can fail: a stream
that is replayed after the fact fails the ordering test, an engine that keeps decoding fails the abort test, a
streamed record that differs from the answered-whole one fails the equality test.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

import httpx
import pytest

from polar_mitm.agent.sdk_agent import join_chat_stream
from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines import processes as engine_processes
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import children
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import read_all

API_KEY = "sk-polar-live-test"
SYSTEM = "You are a coding agent."
USER_TEXT = "Write hello into out.txt"
SHELL_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
SCRIPT = [
    {
        "text": "<think>\nThe user wants a file.\n</think>\n\nLet me write the file.",
        "tool_call": {"name": "shell", "arguments": {"command": "echo hello > out.txt"}},
    },
    "Done: out.txt now says hello.",
]
FINAL_TEXT = "Done: out.txt now says hello."
PROVIDERS = ["anthropic", "openai_chat", "openai_responses", "google"]


# -- processes ---------------------------------------------------------------------------------------------------


def _engine(tmp_path_factory, name: str, extra: list[str]):
    root = tmp_path_factory.mktemp(name)
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    return engine_processes.start_engine(
        "tiny", log=root / "engine.log", extra_args=["--script", str(script), *extra]
    )


def _gateway(tmp_path_factory, name: str, engine: str, options: dict[str, str] | None = None):
    root = tmp_path_factory.mktemp(name)
    gw = gateway_processes.start_gateway(
        engine, root / "flows", confdir=root / "conf", log=root / "gateway.log", options=options
    )
    gw.log = root / "gateway.log"
    return gw


@pytest.fixture(scope="module")
def live_engine(tmp_path_factory):
    proc, url = _engine(tmp_path_factory, "live-engine", [])
    yield url
    children.stop(proc)


@pytest.fixture(scope="module")
def slow_engine(tmp_path_factory):
    """Each token waits 0.15 s: a generation of ~40 tokens takes seconds, so ordering and aborts are visible."""
    proc, url = _engine(tmp_path_factory, "slow-engine", ["--token-delay", "0.15"])
    yield url
    children.stop(proc)


@pytest.fixture(scope="module")
def prefill_engine(tmp_path_factory):
    """The first token comes after 1.5 s (a long prefill); the rest at full speed."""
    proc, url = _engine(tmp_path_factory, "prefill-engine", ["--first-token-delay", "1.5"])
    yield url
    children.stop(proc)


@pytest.fixture(scope="module")
def gateways(live_engine, tmp_path_factory):
    """Live streaming in both prompt modes; `replay` for the answered-whole-then-replayed behaviour."""
    made = {
        "tokens": _gateway(tmp_path_factory, "gw-tokens", live_engine),
        "messages": _gateway(tmp_path_factory, "gw-messages", live_engine, {"polar_prompt_mode": "messages"}),
    }
    yield made
    for gw in made.values():
        gw.stop()


@pytest.fixture(scope="module")
def slow_gateway(slow_engine, tmp_path_factory):
    gw = _gateway(tmp_path_factory, "gw-slow", slow_engine)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def prefill_gateway(prefill_engine, tmp_path_factory):
    gw = _gateway(tmp_path_factory, "gw-prefill", prefill_engine, {"polar_keepalive_seconds": "0.25"})
    yield gw
    gw.stop()


# -- one turn per SDK --------------------------------------------------------------------------------------------


class Turn:
    """One model call through an official SDK: what the client parsed, and the history for the next call."""

    def __init__(self, text: str, calls: list[tuple[str, dict]], events: list[str], history: list) -> None:
        self.text, self.calls, self.events, self.history = text, calls, events, history


def _anthropic(base: str | None, history: list, stream: bool) -> Turn:
    import anthropic

    client = anthropic.Anthropic(api_key=API_KEY, base_url=base, max_retries=0)
    tools = [{"name": "shell", "description": "Run a shell command", "input_schema": SHELL_SCHEMA}]
    kwargs = dict(model="claude-sonnet-4-6", max_tokens=256, system=SYSTEM, messages=history, tools=tools)
    events: list[str] = []
    if stream:
        with client.messages.stream(**kwargs) as s:
            events = [event.type for event in s]
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kwargs)
    calls = [b for b in msg.content if b.type == "tool_use"]
    history = history + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]}
    ]
    if calls:
        history.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": c.id, "content": "ok"} for c in calls],
            }
        )
    text = "".join(b.text for b in msg.content if b.type == "text")
    return Turn(text, [(c.name, c.input) for c in calls], events, history)


def _openai_chat(base: str | None, history: list, stream: bool) -> Turn:
    import openai

    client = openai.OpenAI(api_key=API_KEY, base_url=base, max_retries=0)
    tools = [
        {
            "type": "function",
            "function": {"name": "shell", "description": "Run a shell command", "parameters": SHELL_SCHEMA},
        }
    ]
    messages = history or [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TEXT}]
    events: list[str] = []
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="gpt-4.1",
                messages=messages,
                tools=tools,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        events = ["usage" if chunk.usage else "chunk" for chunk in chunks]
        content, joined = join_chat_stream(chunks)
        calls = [(c["id"], c["name"], c["arguments"]) for c in joined]
    else:
        message = (
            client.chat.completions.create(model="gpt-4.1", messages=messages, tools=tools).choices[0].message
        )
        content = message.content or ""
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    history = messages + [
        {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
            ]
            or None,
        }
    ]
    history += [{"role": "tool", "tool_call_id": i, "content": "ok"} for i, _, _ in calls]
    return Turn(content, [(n, json.loads(a)) for _, n, a in calls], events, history)


def _openai_responses(base: str | None, history: list, stream: bool) -> Turn:
    import openai

    client = openai.OpenAI(api_key=API_KEY, base_url=base, max_retries=0)
    tools = [
        {
            "type": "function",
            "name": "shell",
            "description": "Run a shell command",
            "parameters": SHELL_SCHEMA,
            "strict": False,
        }
    ]
    items = history or [{"role": "user", "content": USER_TEXT}]
    kwargs = dict(
        model="gpt-5-codex",
        input=items,
        tools=tools,
        instructions=SYSTEM,
        store=False,
        include=["reasoning.encrypted_content"],
    )
    events: list[str] = []
    if stream:
        with client.responses.stream(**kwargs) as s:
            events = [event.type for event in s]
            resp = s.get_final_response()
    else:
        resp = client.responses.create(**kwargs)
    calls = [o for o in resp.output if o.type == "function_call"]
    history = items + [o.model_dump(exclude_none=True) for o in resp.output]
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls]
    return Turn(resp.output_text, [(c.name, json.loads(c.arguments)) for c in calls], events, history)


def _google(base: str | None, history: list, stream: bool) -> Turn:
    from google import genai
    from google.genai import types

    client = genai.Client(api_key=API_KEY, http_options=types.HttpOptions(base_url=base) if base else None)
    tool = types.Tool(
        function_declarations=[
            types.FunctionDeclaration(
                name="shell", description="Run a shell command", parameters_json_schema=SHELL_SCHEMA
            )
        ]
    )
    config = types.GenerateContentConfig(
        tools=[tool],
        system_instruction=SYSTEM,
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    contents = history or [types.Content(role="user", parts=[types.Part(text=USER_TEXT)])]
    events: list[str] = []
    if stream:
        parts: list = []
        for chunk in client.models.generate_content_stream(
            model="gemini-2.5-flash", contents=contents, config=config
        ):
            events.append(str(chunk.candidates[0].finish_reason) if chunk.candidates else "chunk")
            if chunk.candidates and chunk.candidates[0].content and chunk.candidates[0].content.parts:
                parts += chunk.candidates[0].content.parts
    else:
        resp = client.models.generate_content(model="gemini-2.5-flash", contents=contents, config=config)
        parts = list(resp.candidates[0].content.parts or [])
    calls = [p.function_call for p in parts if p.function_call]
    history = contents + [types.Content(role="model", parts=parts)]
    if calls:
        history.append(
            types.Content(
                role="user",
                parts=[
                    types.Part.from_function_response(name=c.name, response={"output": "ok"}) for c in calls
                ],
            )
        )
    text = "".join(p.text or "" for p in parts if not p.thought and p.text)
    return Turn(text, [(c.name, dict(c.args or {})) for c in calls], events, history)


TURNS = {
    "anthropic": _anthropic,
    "openai_chat": _openai_chat,
    "openai_responses": _openai_responses,
    "google": _google,
}


def _base(provider: str, gw, mode: str, session: str) -> str | None:
    if mode == "proxy":
        return None
    prefix = SessionId(session).base_url(gw.reverse_url)
    return f"{prefix}/v1" if provider.startswith("openai") else prefix


def _session(provider: str, gw, mode: str, session: str, stream: bool, monkeypatch) -> list[Turn]:
    """Two turns (tool call, then the final answer) of one session."""
    if mode == "proxy":
        monkeypatch.setenv("HTTPS_PROXY", f"http://{session}:x@127.0.0.1:{gw.proxy_port}")
        monkeypatch.setenv("SSL_CERT_FILE", str(gw.ca_bundle()))
        for name in (
            "NO_PROXY",
            "no_proxy",
            "ALL_PROXY",
            "all_proxy",
            "HTTP_PROXY",
            "http_proxy",
            "https_proxy",
        ):
            monkeypatch.delenv(name, raising=False)
    base = _base(provider, gw, mode, session)
    first = TURNS[provider](
        base,
        []
        if provider in ("openai_chat", "openai_responses", "google")
        else [{"role": "user", "content": USER_TEXT}],
        stream,
    )
    second = TURNS[provider](base, first.history, stream)
    return [first, second]


# -- records -------------------------------------------------------------------------------------------------------


def _records(gw, session: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:
        rows = sorted(
            (r for r in read_all(gw.out_dir).to_pylist() if r["session_id"] == session),
            key=lambda r: r["seq"],
        )
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


# Per-call identities and clocks: the only fields a streamed and an answered-whole call may differ in.
VOLATILE_FIELDS = {
    "request_id",
    "session_id",
    "started_at",
    "finished_at",
    "stream",
    "request_json",
    "harness_ids_json",
}
VOLATILE_KEYS = {
    "id",
    "call_id",
    "tool_use_id",
    "tool_call_id",
    "created",
    "created_at",
    "completed_at",
    "responseId",
    "signature",
    "encrypted_content",
    "cached_tokens",  # the engine's prefix cache: the second of two equal calls finds the first one's prefix
}
CALL_ID = re.compile(r"(toolu_)?call_[0-9a-f]{24}")


def _normalised(value: Any) -> Any:
    """JSON with per-call ids and timestamps blanked (the model's tool-call ids are random per call)."""
    if isinstance(value, dict):
        return {k: None if k in VOLATILE_KEYS else _normalised(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalised(v) for v in value]
    if isinstance(value, str):
        return CALL_ID.sub("CALL", value)
    return value


def _comparable(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k not in VOLATILE_FIELDS}
    out["path"] = row["path"].replace(
        ":streamGenerateContent", ":generateContent"
    )  # Google streams by method
    for key in ("response_json", "messages_json"):
        out[key] = _normalised(json.loads(row[key])) if row[key] else None
    meta = json.loads(row["engine_meta_json"] or "{}")  # the rest of meta_info is timing
    out["engine_meta_json"] = {
        k: meta.get(k) for k in ("finish_reason", "prompt_tokens", "completion_tokens", "weight_version")
    }
    # The second call reuses the first one's prefix cache (as on SGLang): same ids, logprobs equal to float error
    # (compared in _assert_same_records).
    out.pop("completion_logprobs", None)
    return out


def _assert_same_records(streamed: list[dict], whole: list[dict]) -> None:
    assert len(streamed) == len(whole) == 2
    for s, w in zip(streamed, whole, strict=True):
        assert s["stream"] is True and w["stream"] is False
        assert s["error"] is None and s["finish_reason"] in ("tool_calls", "stop")
        a, b = _comparable(s), _comparable(w)
        differing = [k for k in a if a[k] != b[k]]
        assert not differing, {k: (a[k], b[k]) for k in differing}
        lp_s, lp_w = s["completion_logprobs"] or [], w["completion_logprobs"] or []
        assert len(lp_s) == len(lp_w) and all(abs(x - y) <= 1e-5 for x, y in zip(lp_s, lp_w, strict=True))


# -- the tests -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["proxy", "reverse"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_sdk_streams_live_and_matches_the_answer_sent_whole(gateways, provider, mode, monkeypatch):
    """Every SDK parses every event of the live stream; text and tool calls equal the non-streamed answer;
    the two calls' records are equal field by field (except ids and clocks)."""
    gw = gateways["tokens"]
    tag = uuid.uuid4().hex[:8]
    streamed = _session(provider, gw, mode, f"live-{provider}-{mode}-{tag}", True, monkeypatch)
    whole = _session(provider, gw, mode, f"whole-{provider}-{mode}-{tag}", False, monkeypatch)
    for s, w in zip(streamed, whole, strict=True):
        assert (s.text, s.calls) == (w.text, w.calls)
        assert len(s.events) > 3  # a stream of events, not one replayed blob
    assert streamed[0].calls == [("shell", {"command": "echo hello > out.txt"})]
    assert streamed[1].text.strip() == FINAL_TEXT
    rows_streamed = _records(gw, f"live-{provider}-{mode}-{tag}")
    rows_whole = _records(gw, f"whole-{provider}-{mode}-{tag}")
    _assert_same_records(rows_streamed, rows_whole)
    # Token-exact prompts: the second call continued the first call's sampled ids.
    assert rows_streamed[1]["prompt_mode"] == "tokens" and rows_streamed[1]["spliced_turns"] == 1
    assert json.loads(rows_streamed[0]["engine_meta_json"])["streamed"] is True


def test_messages_prompt_mode_streams_live_with_equal_records(gateways, monkeypatch):
    gw = gateways["messages"]
    tag = uuid.uuid4().hex[:8]
    streamed = _session("anthropic", gw, "reverse", f"live-msg-{tag}", True, monkeypatch)
    whole = _session("anthropic", gw, "reverse", f"whole-msg-{tag}", False, monkeypatch)
    assert [(t.text, t.calls) for t in streamed] == [(t.text, t.calls) for t in whole]
    rows = _records(gw, f"live-msg-{tag}")
    _assert_same_records(rows, _records(gw, f"whole-msg-{tag}"))
    assert {r["prompt_mode"] for r in rows} == {"messages"}


def test_anthropic_stream_carries_thinking_text_and_tool_use_blocks(gateways):
    """The reasoning arrives as a thinking block (with its signature), then text, then one tool_use block."""
    gw = gateways["tokens"]
    body = {
        "model": "claude-sonnet-4-6",
        "max_tokens": 256,
        "stream": True,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": USER_TEXT}],
        "tools": [{"name": "shell", "description": "Run", "input_schema": SHELL_SCHEMA}],
    }
    url = SessionId(f"blocks-{uuid.uuid4().hex[:6]}").base_url(gw.reverse_url, "/v1/messages")
    with httpx.stream(
        "POST", url, json=body, headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}, timeout=60
    ) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert deltas.count("thinking_delta") > 1 and deltas.count("text_delta") > 1  # token by token
    assert "signature_delta" in deltas
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-1]["type"] == "message_stop"


def test_first_content_event_arrives_while_the_engine_is_still_generating(slow_gateway, slow_engine):
    """Time to first byte: with a known per-token delay, the first text delta reaches the client while the
    engine still reports the generation as running (ordering, not wall-clock thresholds)."""
    body = {"model": "gpt-4.1", "stream": True, "messages": [{"role": "user", "content": USER_TEXT}]}
    running_at_first_content = None
    pieces = []
    url = SessionId(f"ttfb-{uuid.uuid4().hex[:6]}").base_url(slow_gateway.reverse_url, "/v1/chat/completions")
    with httpx.stream(
        "POST", url, json=body, headers={"authorization": f"Bearer {API_KEY}"}, timeout=120
    ) as resp:
        request_id = resp.headers["x-polar-request-id"]
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {})
            if (delta.get("content") or delta.get("reasoning_content")) and running_at_first_content is None:
                stats = httpx.get(
                    f"{slow_engine}/engine_stats", timeout=10, headers=engine_keys.auth_headers(slow_engine)
                ).json()
                running_at_first_content = request_id in stats["running"]
            pieces.append(delta.get("content") or "")
    assert running_at_first_content is True
    stats = httpx.get(
        f"{slow_engine}/engine_stats", timeout=10, headers=engine_keys.auth_headers(slow_engine)
    ).json()
    assert request_id not in stats["running"]
    assert "".join(pieces) == "Let me write the file."


def test_client_disconnect_mid_stream_stops_the_engine_and_records_abort(slow_gateway, slow_engine):
    """The harness hangs up after the first text: the engine aborts the generation (its stats show it stopped
    early) and the record is `abort` with the ids and logprobs sampled so far."""
    session = f"abort-{uuid.uuid4().hex[:6]}"
    body = {
        "model": "claude-sonnet-4-6",
        "max_tokens": 256,
        "stream": True,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": USER_TEXT}],
        "tools": [{"name": "shell", "description": "Run", "input_schema": SHELL_SCHEMA}],
    }
    url = SessionId(session).base_url(slow_gateway.reverse_url, "/v1/messages")
    with httpx.stream(
        "POST", url, json=body, headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}, timeout=60
    ) as resp:
        request_id = resp.headers["x-polar-request-id"]
        for line in resp.iter_lines():
            if '"thinking_delta"' in line:
                break  # hang up mid-stream
    deadline = time.monotonic() + 30
    finished = None
    while time.monotonic() < deadline and finished is None:
        stats = httpx.get(
            f"{slow_engine}/engine_stats", timeout=10, headers=engine_keys.auth_headers(slow_engine)
        ).json()
        finished = next((g for g in stats["recent"] if g["request_id"] == request_id), None)
        time.sleep(0.2)
    assert finished is not None and finished["finish_reason"] == "abort"
    full_turn = 38  # tokens of the scripted first turn (reasoning, text, tool call, end of turn)
    assert 0 < finished["completion_tokens"] < full_turn
    rows = _records(slow_gateway, session)
    deadline = time.monotonic() + 15
    while not rows and time.monotonic() < deadline:
        rows = _records(slow_gateway, session)
    [row] = rows
    assert row["request_id"] == request_id and row["finish_reason"] == "abort" and row["status_code"] == 499
    assert len(row["completion_ids"]) == len(row["completion_logprobs"]) == finished["completion_tokens"]
    assert row["prompt_ids"] and row["error"].startswith("abort:")


def test_keepalive_pings_during_a_slow_first_token_are_accepted_by_the_anthropic_sdk(prefill_gateway):
    import anthropic

    body = {
        "model": "claude-sonnet-4-6",
        "max_tokens": 64,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    url = SessionId(f"ping-{uuid.uuid4().hex[:6]}").base_url(prefill_gateway.reverse_url, "/v1/messages")
    with httpx.stream(
        "POST", url, json=body, headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}, timeout=60
    ) as resp:
        names = [line[7:] for line in resp.iter_lines() if line.startswith("event: ")]
    first_content = names.index("content_block_start")
    assert names[0] == "message_start" and names[first_content - 1] == "ping"
    assert names[:first_content].count("ping") >= 3  # 1.5 s of silence at a 0.25 s keep-alive
    client = anthropic.Anthropic(api_key=API_KEY, base_url=url.removesuffix("/v1/messages"), max_retries=0)
    with client.messages.stream(
        model="claude-sonnet-4-6", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as s:
        message = s.get_final_message()
    # No tools offered: the script's first turn as plain text, parsed whole after the pings.
    assert message.stop_reason == "end_turn" and "Let me write the file." in message.content[-1].text


def test_replay_option_answers_whole_then_replays(live_engine, tmp_path_factory, monkeypatch):
    """`polar_stream=replay` keeps the engine call non-streaming (the record has the engine's full meta_info)."""
    gw = _gateway(tmp_path_factory, "gw-replay", live_engine, {"polar_stream": "replay"})
    try:
        session = f"replay-{uuid.uuid4().hex[:6]}"
        turns = _session("openai_chat", gw, "reverse", session, True, monkeypatch)
        assert turns[1].text.strip() == FINAL_TEXT
        meta = json.loads(_records(gw, session)[0]["engine_meta_json"])
        assert "streamed" not in meta and "e2e_latency" in meta
    finally:
        gw.stop()


def test_engine_stream_adds_up_to_its_answer_for_greedy_random_text(engine_url):
    """The embedded engine, unscripted and greedy: its streamed deltas join to exactly the non-streamed content
    and reasoning, its sglext ids equal the response ids, and every token's logprob came with a chunk."""
    tools = [{"type": "function", "function": {"name": "shell", "parameters": SHELL_SCHEMA}}]
    for prompt, with_tools in (("Say something.", False), ("Run a command.", True), ("Think first.", True)):
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 48,
            "temperature": 0,
            "logprobs": True,
        }
        if with_tools:
            body["tools"] = tools
        whole = httpx.post(
            f"{engine_url}/v1/chat/completions",
            timeout=60,
            json={**body, "return_token_ids": True},
            headers=engine_keys.auth_headers(engine_url),
        ).json()["choices"][0]
        text, reasoning, logprobs, ext = "", "", [], {}
        with httpx.stream(
            "POST",
            f"{engine_url}/v1/chat/completions",
            timeout=60,
            headers=engine_keys.auth_headers(engine_url),
            json={
                **body,
                "stream": True,
                "return_input_ids_in_sglext": True,
                "return_output_ids_in_sglext": True,
            },
        ) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                ext = chunk.get("sglext") or ext
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    logprobs += (choice.get("logprobs") or {}).get("content") or []
        assert text == (whole["message"]["content"] or "")
        assert reasoning == (whole["message"]["reasoning_content"] or "")
        assert ext["output_ids"] == [whole["response_token_ids"]] and ext["input_ids"] == [
            whole["prompt_token_ids"]
        ]
        assert [e["logprob"] for e in logprobs] == pytest.approx(
            [e["logprob"] for e in whole["logprobs"]["content"]], abs=1e-5
        )
