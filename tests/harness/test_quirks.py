"""Harness quirks the gateway handles, each checked on what the real CLIs sent.

Offline: the requests in sample_flows/harness/ (recorded from the real CLIs by scripts/record_harness_flows.py)
decode, as recorded, into the conversation the engine saw. Live, through the gateway: shapes the recorded sessions
do not contain (a compaction turn with empty `tools`, a Codex WebSocket upgrade).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from polar_mitm.codecs import CODECS, detect
from polar_mitm.conversation import Conversation
from polar_mitm.gateway.import_flows import import_flows, iter_flows
from polar_mitm.harness import HARNESSES
from polar_mitm.harness.aider import WHOLE_FORMAT_MARKER
from polar_mitm.harness.openhands import DEFAULT_TOOLS
from polar_mitm.harness.policy import AIDER_EDIT, THINKING
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import read_all

SAMPLES = Path(__file__).resolve().parents[2] / "sample_flows" / "harness"
RECORDED = [name for name in HARNESSES if (SAMPLES / f"{name}.flow").exists()]
needs_samples = pytest.mark.skipif(
    len(RECORDED) < len(HARNESSES), reason="run scripts/record_harness_flows.py"
)


def model_flows(name: str) -> list[Any]:
    """The recorded model calls of one harness session, in order."""
    flows = [f for f in iter_flows([SAMPLES / f"{name}.flow"]) if "polar_record" in f.metadata]
    return sorted(flows, key=lambda f: f.metadata["polar_record"]["seq"])


def body(flow) -> dict[str, Any]:
    return json.loads(flow.request.get_text())


def decode(flow) -> Conversation:
    record = flow.metadata["polar_record"]
    return CODECS[record["provider"]].decode_request(
        body(flow), record["path"], dict(flow.request.query.items())
    )


def main_turns(name: str) -> list[Any]:
    """The agent loop's calls (those offering tools); the rest is side traffic."""
    return [f for f in model_flows(name) if decode(f).tools]


# -- every harness: the recorded requests replay exactly ------------------------------------------------------


@needs_samples
@pytest.mark.parametrize("name", RECORDED or list(HARNESSES))
def test_recorded_requests_decode_to_what_the_engine_saw(name):
    flows = model_flows(name)
    assert len(flows) >= (2 if name == "aider" else 3)  # Aider: the edit, then the fix after its failed test
    for flow in flows:
        record = flow.metadata["polar_record"]
        headers = {k.lower(): v for k, v in flow.request.headers.items()}
        codec = detect(record["path"], headers, body(flow))
        assert codec is not None and codec.name == record["provider"]
        conv = decode(flow)
        assert conv.messages_json() == json.loads(record["messages_json"])
        assert conv.tools_json() == json.loads(record["tools_json"])
        assert not {"authorization", "x-api-key", "x-goog-api-key"} & set(headers)  # credentials scrubbed


@needs_samples
@pytest.mark.parametrize("name", RECORDED or list(HARNESSES))
def test_import_flows_rebuilds_each_harness_session(name, tmp_path):
    shard, counts = import_flows([SAMPLES / f"{name}.flow"], tmp_path)
    recorded = {r["request_id"]: r for r in pq.read_table(SAMPLES / f"{name}.parquet").to_pylist()}
    imported = pq.read_table(shard).to_pylist()
    assert counts["gateway"] == len(recorded) == len(imported)
    for row in imported:
        original = recorded[row["request_id"]]
        for col in ("session_id", "task_id", "seq", "prompt_ids", "completion_ids", "finish_reason"):
            assert row[col] == original[col]


# Aider rebuilds every prompt; OpenClaw ends each with runtime facts that the next one leaves out (its test below).
NO_PREFIX_EXTENSION = {"aider", "openclaw"}


@needs_samples
@pytest.mark.parametrize(
    "name", [name for name in RECORDED or list(HARNESSES) if name not in NO_PREFIX_EXTENSION]
)
def test_each_turn_prompt_extends_the_previous_one_token_for_token(name):
    """What prefix merging relies on: the harness re-sends history that renders to the very same tokens."""
    turns = [f.metadata["polar_record"] for f in main_turns(name)]
    if name == "claude-code":
        turns = turns[
            :3
        ]  # the 4th is /compact: a new user turn, after which earlier thinking is not rendered
    assert len(turns) == 3
    for before, after in zip(turns, turns[1:], strict=False):
        assert after["prompt_ids"][: len(before["prompt_ids"])] == before["prompt_ids"]


# -- Claude Code ----------------------------------------------------------------------------------------------


@needs_samples
def test_claude_code_billing_line_changes_per_request_but_never_reaches_the_engine():
    flows = main_turns("claude-code")
    billing = [body(f)["system"][0]["text"] for f in flows]
    assert all(b.startswith("x-anthropic-billing-header:") for b in billing)
    assert len(set(billing)) == len(billing)  # cch / prompt ids differ on every request
    systems = {decode(f).messages[0].content for f in flows}
    assert len(systems) == 1 and "billing" not in systems.pop()
    for f in flows:
        assert "x-anthropic-billing-header" in f.metadata["polar_record"]["request_json"]  # original kept


@needs_samples
def test_claude_code_deferred_tools_stay_out_of_the_prompt_until_tool_search_loads_them():
    first = main_turns("claude-code")[0]
    request = body(first)
    deferred = [t["name"] for t in request["tools"] if t.get("defer_loading")]
    assert deferred and "ToolSearch" in [t["name"] for t in request["tools"]]
    offered = [t.name for t in decode(first).tools]
    assert "ToolSearch" in offered and not set(deferred) & set(offered)
    # A tool search result references a deferred tool: from then on the model sees its schema (as on the API).
    loaded = copy.deepcopy(request)
    loaded["tools"].append(
        {
            "name": "WebFetch",
            "description": "Fetch a URL",
            "defer_loading": True,
            "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}},
        }
    )
    loaded["messages"] += [
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_ts",
                    "name": "ToolSearch",
                    "input": {"query": "select:WebFetch"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_ts",
                    "content": [{"type": "tool_reference", "tool_name": "WebFetch"}],
                }
            ],
        },
    ]
    conv = CODECS["anthropic"].decode_request(loaded, "/v1/messages", {})
    assert "WebFetch" in [t.name for t in conv.tools]
    assert conv.messages[-1].role == "tool" and conv.messages[-1].name == "ToolSearch"


@needs_samples
def test_claude_code_environment_arrives_as_a_mid_conversation_system_message():
    conv = decode(main_turns("claude-code")[0])
    roles = [m.role for m in conv.messages]
    assert roles[0] == "system" and "system" in roles[1:]
    assert any("Primary working directory" in m.content for m in conv.messages[1:] if m.role == "system")


@needs_samples
def test_claude_code_thinking_blocks_come_back_with_their_text():
    conv = decode(main_turns("claude-code")[1])
    assistant = [m for m in conv.messages if m.role == "assistant"]
    assert assistant[0].reasoning == THINKING


def test_compaction_turn_with_empty_tools_is_answered_with_text(gateway):
    """Claude Code's compaction shape: the whole conversation, `tools: []`, a request for a summary."""
    request = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 20000,
        "stream": True,
        "tools": [],
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cch=1a2b3;"},
            {"type": "text", "text": "You are a helpful AI assistant tasked with summarizing conversations."},
        ],
        "messages": [
            {"role": "user", "content": "Write hello into out.txt"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Bash",
                        "input": {"command": "echo hello > out.txt"},
                    }
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": ""}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
            {
                "role": "user",
                "content": "Your task is to create a detailed summary of the conversation so far.",
            },
        ],
    }
    r = httpx.post(
        SessionId("compaction").base_url(gateway.reverse_url, "/v1/messages"),
        json=request,
        timeout=60,
        headers={"anthropic-version": "2023-06-01", "x-api-key": "k"},
    )
    assert r.status_code == 200 and "event: message_stop" in r.text
    assert "tool_use" not in r.text  # no tools offered: the engine is never asked for a tool call
    row = next(row for row in read_all(gateway.out_dir).to_pylist() if row["session_id"] == "compaction")
    assert row["tools_json"] == "[]" and row["finish_reason"] == "stop" and row["completion_ids"]
    assert "billing" not in row["messages_json"]


# -- Codex and the Responses API ------------------------------------------------------------------------------


@needs_samples
def test_codex_developer_messages_reasoning_items_and_store_false():
    turns = main_turns("codex")
    first, second = body(turns[0]), body(turns[1])
    assert first["store"] is False and first["include"] == ["reasoning.encrypted_content"]
    assert (
        first["reasoning"] and [i["role"] for i in first["input"] if i.get("role")][:2] == ["developer"] * 2
    )
    conv = decode(turns[0])
    assert [m.role for m in conv.messages[:2]] == ["system", "system"]
    # Our answer carried the reasoning sealed in encrypted_content; Codex sends the item back untouched.
    sent_back = next(i for i in second["input"] if i.get("type") == "reasoning")
    assert sent_back["encrypted_content"]
    assistant = next(m for m in decode(turns[1]).messages if m.role == "assistant")
    assert assistant.reasoning == THINKING


@needs_samples
@pytest.mark.parametrize("name", ["codex", "pi", "hermes"])
def test_responses_function_call_output_becomes_the_tool_result(name):
    second = main_turns(name)[1]
    items = body(second)["input"]
    call = next(i for i in items if i.get("type") == "function_call")
    output = next(i for i in items if i.get("type") == "function_call_output")
    tool = next(m for m in decode(second).messages if m.role == "tool")
    assert tool.tool_call_id == output["call_id"] == call["call_id"]
    assert tool.name == call["name"] and tool.content == output["output"]


def test_websocket_upgrade_is_refused_at_once_so_codex_falls_back_to_https(gateway):
    headers = {
        "connection": "Upgrade",
        "upgrade": "websocket",
        "sec-websocket-version": "13",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
        "authorization": "Bearer polar-ws-check",
    }
    before = len(read_all(gateway.out_dir))
    r = httpx.get(
        SessionId("ws-check").base_url(gateway.reverse_url, "/v1/responses"), headers=headers, timeout=10
    )
    assert r.status_code == 426
    assert "WebSocket" in r.json()["error"]["message"]
    assert len(read_all(gateway.out_dir)) == before  # not a model call: nothing recorded


# -- Gemini CLI -----------------------------------------------------------------------------------------------


@needs_samples
def test_gemini_thinking_config_asks_for_thoughts_and_gets_them():
    turns = main_turns("gemini")
    config = body(turns[0])["generationConfig"]["thinkingConfig"]
    assert config["includeThoughts"] is True and "thinkingLevel" in config
    assert decode(turns[0]).thinking is True
    parts = json.loads(turns[0].metadata["polar_record"]["response_json"])["candidates"][0]["content"][
        "parts"
    ]
    assert parts[0] == {"text": THINKING, "thought": True}


@pytest.mark.parametrize(
    ("config", "thinking"),
    [
        ({"includeThoughts": True, "thinkingLevel": "HIGH"}, True),
        ({"thinkingLevel": "LOW"}, None),
        ({"thinkingBudget": -1, "includeThoughts": False}, None),
        ({"thinkingBudget": 0}, False),
    ],
)
def test_gemini_thinking_config_variants_decode(config, thinking):
    request = {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "generationConfig": {"thinkingConfig": config},
    }
    assert (
        CODECS["google"].decode_request(request, "/v1beta/models/g:generateContent", {}).thinking is thinking
    )


@needs_samples
def test_gemini_routing_classifier_is_side_traffic_answered_in_json():
    router = next(f for f in model_flows("gemini") if not decode(f).tools)
    assert body(router)["generationConfig"]["responseMimeType"] == "application/json"
    answer = json.loads(router.metadata["polar_record"]["response_json"])
    verdict = json.loads(answer["candidates"][0]["content"]["parts"][0]["text"])
    assert set(verdict) == {"complexity_reasoning", "complexity_score"}


# -- Qwen Code and opencode -----------------------------------------------------------------------------------


@needs_samples
def test_qwen_tool_results_as_content_parts_become_plain_text():
    second = main_turns("qwen")[1]
    raw = next(m for m in body(second)["messages"] if m["role"] == "tool")
    assert isinstance(raw["content"], list)
    tool = next(m for m in decode(second).messages if m.role == "tool")
    assert tool.content == "".join(part["text"] for part in raw["content"])


@needs_samples
def test_opencode_title_generation_is_a_tool_free_side_call():
    side = [f for f in model_flows("opencode") if not decode(f).tools]
    assert len(side) == 1 and "title" in body(side[0])["system"][0]["text"].lower()
    assert side[0].metadata["polar_record"]["finish_reason"] == "stop"


# -- mini-swe-agent (litellm) ---------------------------------------------------------------------------------


@needs_samples
def test_mini_swe_agent_asks_for_whole_answers_with_one_bash_tool_and_no_budget():
    """litellm's openai/ provider as mini-swe-agent calls it: not streamed, no max_tokens or sampling settings
    (the gateway's polar_max_tokens cap and its own sampling defaults apply), the `bash` tool only."""
    for flow in model_flows("mini-swe-agent"):
        request = body(flow)
        assert not request.get("stream") and flow.response.headers["content-type"] == "application/json"
        assert not {"max_tokens", "max_completion_tokens", "temperature", "top_p"} & set(request)
        assert [t["function"]["name"] for t in request["tools"]] == ["bash"]
        assert flow.request.headers["user-agent"].startswith("OpenAI/Python")


@needs_samples
def test_mini_swe_agent_sends_reasoning_content_and_json_observations_back():
    """Its history is litellm's message objects dumped as they came: our `reasoning_content` returns verbatim
    (hence 100% context-exact even in messages mode), tool results are its JSON observation template."""
    last = main_turns("mini-swe-agent")[-1]
    sent = body(last)["messages"]
    calls = [m for m in sent if m["role"] == "assistant"]
    assert calls[0]["reasoning_content"] == THINKING and "reasoning_content" not in calls[1]
    results = [m for m in sent if m["role"] == "tool"]
    assert [r["tool_call_id"] for r in results] == [c["tool_calls"][0]["id"] for c in calls]
    assert json.loads(results[-1]["content"]) == {"returncode": 0, "output": "hello\n"}
    conv = decode(last)
    assert [m.reasoning for m in conv.messages if m.role == "assistant"][0] == THINKING
    assert [m.content for m in conv.messages if m.role == "tool"] == [r["content"] for r in results]


# -- Aider ----------------------------------------------------------------------------------------------------


@needs_samples
def test_aider_streams_without_tools_and_rebuilds_each_prompt_around_the_conversation():
    """No tools (the edit is text in its format); each prompt is rebuilt — the chat's files before the
    conversation, the format reminder after it, a canned reply after an applied edit — so no call extends the
    previous one, and the gateway opens a new chain while the sampled answer comes back verbatim."""
    first, second = model_flows("aider")
    requests = [body(first), body(second)]
    for request in requests:
        assert request["stream"] is True and "tools" not in request
        assert request["messages"][-1]["role"] == "system"
        assert request["messages"][-1]["content"].startswith(WHOLE_FORMAT_MARKER)
    sent = requests[1]["messages"]
    answer = next(
        i for i, m in enumerate(sent) if m["role"] == "assistant" and m["content"] == AIDER_EDIT["text"]
    )
    assert sent[answer + 1] == {"role": "user", "content": "I updated the files."}
    assert any("I ran this command" in m["content"] for m in sent[answer + 1 :])  # the failed test's output
    before, after = first.metadata["polar_record"], second.metadata["polar_record"]
    assert after["prompt_ids"][: len(before["prompt_ids"])] != before["prompt_ids"]
    assert (after["spliced_turns"], after["splice_reason"]) == (0, "no prefix match")
    assert {before["call_kind"], after["call_kind"]} == {
        "side"
    }  # the gateway's no-tools rule (recipes/aider.md)


# -- Cline ----------------------------------------------------------------------------------------------------


@needs_samples
def test_cline_drops_reasoning_and_reserialises_arguments_on_the_responses_api():
    """openai-native (proxy mode): Responses with a system input item, no `store: false`, no encrypted reasoning —
    the reasoning item it got is not sent back, and tool arguments come back compact. Tokens mode keeps the
    sampled tokens; messages mode drifts (test_harnesses.py)."""
    first, second = main_turns("cline")[:2]
    request = body(second)
    assert (
        request["input"][0]["role"] == "system" and "store" not in request and request["truncation"] == "auto"
    )
    assert "reasoning.encrypted_content" not in request.get("include", [])
    answer = json.loads(first.metadata["polar_record"]["response_json"])["output"]
    assert answer[0]["type"] == "reasoning"  # what we answered ...
    assert not [i for i in request["input"] if i.get("type") == "reasoning"]  # ... and it left out
    call = next(i for i in request["input"] if i.get("type") == "function_call")
    assert call["name"] == "run_commands" and call["arguments"] == '{"commands":["echo hello > out.txt"]}'
    output = next(i for i in request["input"] if i.get("type") == "function_call_output")
    assert json.loads(output["output"])[0]["query"] == "echo hello > out.txt"
    assert second.metadata["polar_record"]["prompt_mode"] == "tokens"  # spliced all the same


# -- Kilo -----------------------------------------------------------------------------------------------------


@needs_samples
def test_kilo_titles_its_session_on_a_smaller_model_with_thinking_as_a_side_call():
    """opencode's shape under Kilo's name: the loop on the configured model with 16 tools, then a tool-free title
    call on claude-haiku with extended thinking and a `title-` session header; the gateway records it as side."""
    flows = model_flows("kilo")
    loop = [f for f in flows if decode(f).tools]
    side = [f for f in flows if not decode(f).tools]
    assert {body(f)["model"] for f in loop} == {"claude-sonnet-4-5"} and len(body(loop[0])["tools"]) == 16
    assert body(loop[0])["system"][0]["text"].startswith("You are Kilo")
    [title] = side
    request = body(title)
    assert request["model"].startswith("claude-haiku") and request["thinking"]["type"] == "enabled"
    assert "title generator" in request["system"][0]["text"]
    assert title.request.headers["x-session-id"] == "title-" + loop[0].request.headers["x-session-id"]
    assert title.metadata["polar_record"]["call_kind"] == "side"


# -- Hermes Agent ---------------------------------------------------------------------------------------------


@needs_samples
def test_hermes_sends_sealed_reasoning_back_but_reserialises_arguments_on_the_responses_api():
    """openai-api provider (proxy mode): streamed Responses with `store: false`, encrypted reasoning included and a
    stable `prompt_cache_key`; the reasoning item comes back with its sealed content and its summary, tool
    arguments come back compact and tool results are its JSON envelope. Tokens mode keeps the sampled tokens;
    messages mode drifts (test_harnesses.py)."""
    first, second, third = main_turns("hermes")
    requests = [body(first), body(second), body(third)]
    for request in requests:
        assert request["stream"] is True and request["store"] is False
        assert request["include"] == ["reasoning.encrypted_content"]
        assert sorted(t["name"] for t in request["tools"]) == [
            "patch",
            "process",
            "read_file",
            "search_files",
            "terminal",
            "write_file",
        ]
    assert (
        len({r["prompt_cache_key"] for r in requests}) == 1
        and len({r["instructions"] for r in requests}) == 1
    )
    assert first.request.headers["user-agent"].startswith("OpenAI/Python")
    sent = requests[1]["input"]
    reasoning = next(i for i in sent if i.get("type") == "reasoning")
    assert reasoning["encrypted_content"] and reasoning["summary"][0]["text"] == THINKING
    call = next(i for i in sent if i.get("type") == "function_call")
    assert call["name"] == "terminal" and call["arguments"] == '{"command":"echo hello > out.txt"}'
    sampled = json.loads(first.metadata["polar_record"]["response_json"])
    ours = next(i for i in sampled["output"] if i.get("type") == "function_call")
    assert ours["arguments"] != call["arguments"]  # what we answered, before Hermes re-serialised it
    output = next(i for i in requests[2]["input"] if i.get("type") == "function_call_output")
    assert json.loads(output["output"]) == {"output": "", "exit_code": 0, "error": None}
    assistant = next(m for m in decode(second).messages if m.role == "assistant")
    assert assistant.reasoning == THINKING
    assert [f.metadata["polar_record"]["prompt_mode"] for f in (second, third)] == ["tokens", "tokens"]


@needs_samples
def test_hermes_pricing_lookup_is_a_model_listing_answered_by_the_gateway():
    """After a call Hermes estimates its cost from the endpoint's `/v1/models`: side traffic the gateway answers
    itself, never recorded as a model call (its context-length probe is off: the preset gives context_length)."""
    flows = list(iter_flows([SAMPLES / "hermes.flow"]))
    others = [f for f in flows if "polar_record" not in f.metadata]
    assert [(f.request.method, f.request.host, f.request.path) for f in others] == [
        ("GET", "api.openai.com", "/v1/models")
    ]
    assert others[0].response.status_code == 200 and "data" in others[0].response.json()


# -- OpenClaw -------------------------------------------------------------------------------------------------


@needs_samples
def test_openclaw_appends_runtime_facts_that_it_drops_from_history_so_no_call_extends_the_last():
    """anthropic provider (proxy mode): streamed Messages with adaptive thinking (`block_binding`), server-side
    `context_management` (clear_tool_uses) and `output_config.effort`. Every call ends with a fresh user message of
    runtime facts (`<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>`: active exec sessions, subagents) that the next call
    leaves out of its history, so no call's prompt extends the last one's: each opens its own chain, exact on its
    own (test_harnesses.py: 100% context-exact, one sequence per call)."""
    flows = main_turns("openclaw")
    requests = [body(f) for f in flows]
    assert len(flows) == len(model_flows("openclaw")) == 3  # no side calls
    for request in requests:
        assert request["model"] == "claude-sonnet-4-6" and request["stream"] is True
        assert request["thinking"]["type"] == "adaptive" and "block_binding" in request["thinking"]
        [edit] = request["context_management"]["edits"]
        assert edit["type"].startswith("clear_tool_uses")
        assert "exec" in {t["name"] for t in request["tools"]} and len(request["tools"]) == 12
        facts = request["messages"][-1]
        assert facts["role"] == "user" and facts["content"][0]["text"].startswith(
            "<<<BEGIN_OPENCLAW_INTERNAL"
        )
    # The facts of call 1 are gone from call 2's history: the tool result follows the sampled answer directly.
    history = requests[1]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "user", "user"]
    assert history[2]["content"][0]["type"] == "tool_result"
    assert sum("INTERNAL_CONTEXT" in json.dumps(m) for m in history) == 1
    # Its thinking comes back signed, its tool call as sampled.
    thinking, _, call = history[1]["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == THINKING and thinking["signature"]
    assert call["name"] == "exec" and call["input"] == {"command": "echo hello > out.txt"}
    records = [f.metadata["polar_record"] for f in flows]
    assert [r["splice_reason"] for r in records[1:]] == ["no prefix match", "no prefix match"]


# -- OpenHands ------------------------------------------------------------------------------------------------


@needs_samples
def test_openhands_sends_whole_chat_requests_drops_reasoning_and_keeps_arguments_as_sampled():
    """The OpenHands SDK through litellm's openai/ provider (proxy mode): Chat Completions, not streamed,
    `max_completion_tokens: 32768`, no sampling settings, the conversation id as `prompt_cache_key`, six tools.
    History: our tool call comes back with the arguments as sampled (`security_risk` included), our
    `reasoning_content` is dropped, tool results are the terminal's observation as content parts. Tokens mode
    splices every turn (test_harnesses.py)."""
    flows = main_turns("openhands")
    assert len(flows) == len(model_flows("openhands")) == 3  # no side model calls
    requests = [body(f) for f in flows]
    for request in requests:
        assert not request.get("stream") and flows[0].response.headers["content-type"] == "application/json"
        assert request["max_completion_tokens"] == 32768
        assert not {"temperature", "top_p", "max_tokens", "reasoning_effort"} & set(request)
        assert [t["function"]["name"] for t in request["tools"]] == DEFAULT_TOOLS
        terminal = request["tools"][0]["function"]["parameters"]
        assert {"command", "security_risk", "summary"} <= set(terminal["properties"])
    assert len({r["prompt_cache_key"] for r in requests}) == 1
    assert flows[0].request.headers["user-agent"].startswith("OpenAI/Python")
    sampled = json.loads(flows[0].metadata["polar_record"]["response_json"])["choices"][0]["message"]
    assert sampled["reasoning_content"] == THINKING
    resent = next(m for m in requests[1]["messages"] if m["role"] == "assistant")
    assert "reasoning_content" not in resent and resent["content"] == [
        {"type": "text", "text": sampled["content"]}
    ]
    assert (
        resent["tool_calls"][0]["function"]["arguments"] == sampled["tool_calls"][0]["function"]["arguments"]
    )
    results = [m for m in requests[2]["messages"] if m["role"] == "tool"]
    assert [r["name"] for r in results] == ["terminal", "terminal"]
    assert results[1]["content"][0]["text"].startswith("hello\n[The command completed with exit code 0.]")
    tool_texts = [m.content for m in decode(flows[2]).messages if m.role == "tool"]
    assert tool_texts == [r["content"][0]["text"] for r in results]  # content parts become plain text
    records = [f.metadata["polar_record"] for f in flows]
    assert [r["prompt_mode"] for r in records[1:]] == ["tokens", "tokens"]


@needs_samples
def test_openhands_update_check_is_refused_by_the_gateway_and_never_recorded():
    """Every run, headless too, the CLI asks PyPI for its latest version (2 s timeout, errors ignored): the
    gateway answers it 404 as not a model call (base-URL mode: the dead proxy refuses it)."""
    others = [f for f in iter_flows([SAMPLES / "openhands.flow"]) if "polar_record" not in f.metadata]
    assert [(f.request.method, f.request.host, f.request.path) for f in others] == [
        ("GET", "pypi.org", "/pypi/openhands/json")
    ]
    assert others[0].response.status_code == 404
    assert others[0].request.headers["user-agent"] == "openhands-cli/1.16.0"
