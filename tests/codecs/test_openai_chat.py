"""The Chat Completions codec: harness requests decode into the right Conversation, and every answer it writes
is accepted by the official openai SDK types (ChatCompletion, ChatCompletionChunk) and by the SDK client."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import BadRequestError, OpenAI
from openai._streaming import SSEDecoder
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from polar_mitm.codecs.base import GatewayError
from polar_mitm.codecs.openai_chat import OpenAIChatCodec
from polar_mitm.conversation import Completion, Conversation, Message, Tool, ToolCall

CODEC = OpenAIChatCodec()

SHELL_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
READ_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}

# Shaped like Qwen Code's second request: system prompt with cache_control parts, a tool call answered.
QWEN_CODE_REQUEST: dict[str, Any] = {
    "model": "qwen3-coder-plus",
    "messages": [
        {
            "role": "system",
            "content": [
                {
                    "type": "text",
                    "cache_control": {"type": "ephemeral"},
                    "text": "You are Qwen Code, an interactive CLI agent.",
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<env>cwd: /repo</env>"},
                {"type": "text", "text": "List the files."},
            ],
        },
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "The user wants a listing.",
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "run_shell_command", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "README.md\nsrc"},
        {"role": "user", "content": "Now read README.md"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "run_shell_command",
                "description": "Run a shell command",
                "parameters": SHELL_SCHEMA,
            },
        },
        {"type": "function", "function": {"name": "read_file", "parameters": READ_SCHEMA}},
    ],
    "tool_choice": "auto",
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 2048,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "metadata": {"sessionId": "s-1", "promptId": "p-9"},
}


def make_completion(
    content: str = "",
    reasoning: str | None = None,
    tool_calls: list[ToolCall] | None = None,
    finish_reason: str = "stop",
    n_prompt: int = 11,
    n_completion: int = 5,
) -> Completion:
    return Completion(
        id="chatcmpl-7f3a9c",
        model="engine-model",
        content=content,
        reasoning=reasoning,
        tool_calls=tool_calls or [],
        finish_reason=finish_reason,  # type: ignore[arg-type]
        prompt_ids=list(range(n_prompt)),
        completion_ids=list(range(100, 100 + n_completion)),
        completion_logprobs=[-0.5] * n_completion,
        weight_version="3",
    )


LONG_ANSWER = "README.md says: polar-mitm records token ids between agent harnesses and the engine. " * 3
TOOL_ANSWER = make_completion(
    content="Let me read it.",
    reasoning="I need the file contents before answering; the read_file tool does that.",
    tool_calls=[
        ToolCall("call_1", "read_file", '{"path": "README.md"}'),
        ToolCall("call_2", "run_shell_command", '{"command": "wc -l README.md && head -n 40 README.md"}'),
    ],
    finish_reason="tool_calls",
)


def conversation(**fields: Any) -> Conversation:
    return CODEC.decode_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, "/v1/chat/completions", {}
    )


def sse_payloads(frames: list[bytes]) -> list[str]:
    """The `data:` payloads of an SSE byte stream, parsed by the openai SDK's own decoder."""
    return [event.data for event in SSEDecoder().iter_bytes(iter(frames))]


def stream_chunks(conv: Conversation, completion: Completion) -> list[ChatCompletionChunk]:
    payloads = sse_payloads(list(CODEC.encode_stream(conv, completion)))
    assert payloads[-1] == "[DONE]"
    return [ChatCompletionChunk.model_validate(json.loads(data)) for data in payloads[:-1]]


def assemble(chunks: list[ChatCompletionChunk]) -> dict[str, Any]:
    """What a client rebuilds from the deltas."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += (call.function and call.function.name) or ""
                entry["arguments"] += (call.function and call.function.arguments) or ""
            finish = choice.finish_reason or finish
    return {
        "content": content,
        "reasoning": reasoning,
        "finish_reason": finish,
        "tool_calls": [calls[i] for i in sorted(calls)],
    }


# ---- paths -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/s/SESSION/v1/chat/completions",
        "/api/v1/chat/completions",
        "/chat/completions",
        "/v1/chat/completions/",
    ],
)
def test_matches_chat_completions_under_any_prefix(path):
    assert CODEC.matches(path)


@pytest.mark.parametrize(
    "path", ["/v1/responses", "/v1/messages", "/v1/completions", "/v1/chat/completions/x"]
)
def test_does_not_match_other_endpoints(path):
    assert not CODEC.matches(path)


# ---- decoding ----------------------------------------------------------------------------------------------


def test_qwen_code_request_decodes_to_the_full_conversation():
    conv = CODEC.decode_request(QWEN_CODE_REQUEST, "/v1/chat/completions", {})
    assert conv.messages == [
        Message(role="system", content="You are Qwen Code, an interactive CLI agent."),
        Message(role="user", content="<env>cwd: /repo</env>List the files."),
        Message(
            role="assistant",
            content="",
            reasoning="The user wants a listing.",
            tool_calls=[ToolCall("call_abc", "run_shell_command", '{"command": "ls"}')],
        ),
        Message(role="tool", content="README.md\nsrc", tool_call_id="call_abc"),
        Message(role="user", content="Now read README.md"),
    ]
    assert conv.tools == [
        Tool("run_shell_command", "Run a shell command", SHELL_SCHEMA),
        Tool("read_file", "", READ_SCHEMA),
    ]
    assert (conv.model, conv.tool_choice, conv.max_tokens, conv.temperature, conv.top_p, conv.top_k) == (
        "qwen3-coder-plus",
        "auto",
        2048,
        0.7,
        0.8,
        20,
    )
    assert conv.stream and conv.include_usage and conv.thinking is None
    assert conv.extra == {"metadata": {"sessionId": "s-1", "promptId": "p-9"}}


def test_developer_and_legacy_function_roles_map_to_system_and_tool():
    conv = CODEC.decode_request(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be terse."},
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "function_call": {"name": "weather", "arguments": "{}"},
                },
                {"role": "function", "name": "weather", "content": "sunny"},
            ],
        },
        "/v1/chat/completions",
        {},
    )
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "tool"]
    call = conv.messages[2].tool_calls[0]
    assert (call.name, call.arguments) == ("weather", "{}")
    assert (conv.messages[3].tool_call_id, conv.messages[3].name) == (call.id, "weather")


def test_reasoning_field_and_object_arguments_are_accepted():
    conv = conversation(
        messages=[
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "reasoning": "thinking out loud",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
                ],
            },
        ]
    )
    assert conv.messages[1].reasoning == "thinking out loud"
    assert conv.messages[1].tool_calls == [ToolCall("c1", "f", '{"a": 1}')]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "function": {"name": "read_file"}}, {"name": "read_file"}),
    ],
)
def test_tool_choice_is_normalised(choice, expected):
    assert conversation(tool_choice=choice).tool_choice == expected


@pytest.mark.parametrize(
    ("fields", "thinking"),
    [
        ({"reasoning_effort": "high"}, True),
        ({"reasoning_effort": "low"}, True),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "minimal"}, False),
        ({}, None),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
    ],
)
def test_reasoning_effort_sets_thinking(fields, thinking):
    assert conversation(**fields).thinking is thinking


def test_max_completion_tokens_wins_over_max_tokens_and_stop_becomes_a_list():
    conv = conversation(max_completion_tokens=64, max_tokens=9, stop="\n\n")
    assert (conv.max_tokens, conv.stop) == (64, ["\n\n"])
    assert conversation(stop=["END", "STOP"]).stop == ["END", "STOP"]


def test_non_function_tools_are_skipped():
    conv = conversation(tools=[{"type": "web_search"}, {"type": "function", "function": {"name": "f"}}])
    assert conv.tools == [Tool("f")]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ],
)
def test_images_audio_and_files_are_rejected_as_invalid_requests(part):
    with pytest.raises(GatewayError) as caught:
        conversation(messages=[{"role": "user", "content": [{"type": "text", "text": "look"}, part]}])
    assert caught.value.kind == "invalid_request"
    assert "not supported" in caught.value.message and "images" in caught.value.message


@pytest.mark.parametrize(
    "body",
    [
        [],
        "hello",
        {"model": "m"},
        {"model": "m", "messages": []},
        {"model": "m", "messages": {"role": "user"}},
        {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "m", "messages": ["hi"]},
        {"model": "m", "messages": [{"role": "user", "content": 42}]},
        {"model": 7, "messages": [{"role": "user", "content": "x"}]},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": True},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": 5},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"},
        {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]},
    ],
)
def test_malformed_requests_raise_invalid_request(body):
    with pytest.raises(GatewayError) as caught:
        CODEC.decode_request(body, "/v1/chat/completions", {})
    assert caught.value.kind == "invalid_request"


def test_more_than_one_choice_is_refused():
    with pytest.raises(GatewayError, match="n>1 not supported"):
        conversation(n=2)
    assert conversation(n=1).extra == {"n": 1}


# ---- non-streaming answers ---------------------------------------------------------------------------------


def test_response_validates_and_carries_text_reasoning_tools_and_usage():
    conv = CODEC.decode_request(QWEN_CODE_REQUEST, "/v1/chat/completions", {})
    answer = ChatCompletion.model_validate(CODEC.encode_response(conv, TOOL_ANSWER))
    assert answer.id.startswith("chatcmpl-") and answer.object == "chat.completion"
    assert answer.model == "qwen3-coder-plus"
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.logprobs is None
    assert choice.message.content == "Let me read it."
    assert choice.message.model_extra["reasoning_content"] == TOOL_ANSWER.reasoning
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("call_1", "function", "read_file", '{"path": "README.md"}'),
        ("call_2", "function", "run_shell_command", '{"command": "wc -l README.md && head -n 40 README.md"}'),
    ]
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (11, 5, 16)


def test_content_is_null_when_the_answer_is_only_tool_calls():
    completion = make_completion(tool_calls=[ToolCall("c", "f", "{}")], finish_reason="tool_calls")
    message = CODEC.encode_response(conversation(), completion)["choices"][0]["message"]
    assert message["content"] is None and "reasoning_content" not in message


@pytest.mark.parametrize(
    ("finish", "calls", "expected"),
    [
        ("stop", [], "stop"),
        ("length", [], "length"),
        ("abort", [], "stop"),
        ("error", [], "stop"),
        ("stop", [ToolCall("c", "f", "{}")], "tool_calls"),
    ],
)
def test_finish_reasons_map_to_openai_names(finish, calls, expected):
    completion = make_completion("x", tool_calls=calls, finish_reason=finish)
    answer = CODEC.encode_response(conversation(), completion)
    assert ChatCompletion.model_validate(answer).choices[0].finish_reason == expected


# ---- streaming ---------------------------------------------------------------------------------------------


def test_stream_chunks_validate_and_assemble_to_the_non_streamed_answer():
    conv = conversation()
    chunks = stream_chunks(conv, TOOL_ANSWER)
    message = CODEC.encode_response(conv, TOOL_ANSWER)["choices"][0]["message"]
    assembled = assemble(chunks)
    assert assembled == {
        "content": message["content"],
        "reasoning": message["reasoning_content"],
        "finish_reason": "tool_calls",
        "tool_calls": [
            {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message["tool_calls"]
        ],
    }
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)


def test_long_content_streams_in_several_pieces():
    chunks = stream_chunks(conversation(), make_completion(LONG_ANSWER))
    pieces = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3 and "".join(pieces) == LONG_ANSWER


def test_tool_call_deltas_open_with_id_and_name_then_carry_only_arguments():
    deltas = [
        call
        for chunk in stream_chunks(conversation(), TOOL_ANSWER)
        for call in (chunk.choices[0].delta.tool_calls or [])
    ]
    openers = [d for d in deltas if d.id is not None]
    assert [(d.index, d.id, d.type, d.function.name, d.function.arguments) for d in openers] == [
        (0, "call_1", "function", "read_file", ""),
        (1, "call_2", "function", "run_shell_command", ""),
    ]
    rest = [d for d in deltas if d.id is None]
    assert rest and all(d.type is None and d.function.name is None and d.function.arguments for d in rest)
    assert len([d for d in rest if d.index == 1]) > 1  # long arguments come in pieces


def test_usage_chunk_comes_last_when_asked():
    conv = conversation(stream=True, stream_options={"include_usage": True})
    raw = [json.loads(data) for data in sse_payloads(list(CODEC.encode_stream(conv, TOOL_ANSWER)))[:-1]]
    assert all("usage" in chunk and chunk["usage"] is None for chunk in raw[:-1])
    assert raw[-1]["choices"] == [] and raw[-1]["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 5,
        "total_tokens": 16,
    }
    assert raw[-2]["choices"][0]["finish_reason"] == "tool_calls" and raw[-2]["choices"][0]["delta"] == {}


def test_no_usage_anywhere_unless_asked():
    frames = list(CODEC.encode_stream(conversation(stream=True), make_completion("hello")))
    assert frames[-1] == b"data: [DONE]\n\n"
    assert all("usage" not in json.loads(data) for data in sse_payloads(frames)[:-1])
    assert all(frame.startswith(b"data: ") and b"event:" not in frame for frame in frames)


# ---- errors and models -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "status", "error_type", "code"),
    [
        ("invalid_request", 400, "invalid_request_error", None),
        ("context_length", 400, "invalid_request_error", "context_length_exceeded"),
        ("not_found", 404, "invalid_request_error", "unknown_url"),
        ("overloaded", 503, "server_error", "engine_unavailable"),
        ("engine_error", 502, "server_error", "engine_error"),
    ],
)
def test_errors_have_openai_shape_and_status(kind, status, error_type, code):
    answer = CODEC.encode_error(GatewayError(kind, "something went wrong"))
    assert answer.status == status and answer.content_type == "application/json"
    assert json.loads(answer.body) == {
        "error": {"message": "something went wrong", "type": error_type, "param": None, "code": code}
    }


@pytest.mark.parametrize(
    ("path", "method", "expected"),
    [
        ("/v1/models", "GET", True),
        ("/models", "GET", True),
        ("/s/abc/v1/models", "GET", True),
        ("/v1/models/qwen3", "GET", True),
        ("/v1/models/Qwen/Qwen3-8B", "GET", True),
        ("/v1/models", "POST", False),
        ("/v1/chat/completions", "GET", False),
    ],
)
def test_models_paths(path, method, expected):
    assert CODEC.models_path(path, method) is expected


def test_models_listing_and_lookup():
    from openai.types import Model

    listing = CODEC.encode_models(["qwen3", "tiny"], "/v1/models")
    assert listing["object"] == "list"
    assert [Model.model_validate(m).id for m in listing["data"]] == ["qwen3", "tiny"]
    one = Model.model_validate(CODEC.encode_models(["qwen3"], "/v1/models/Qwen/Qwen3-8B"))
    assert (one.id, one.owned_by) == ("Qwen/Qwen3-8B", "polar-mitm")
    assert not CODEC.count_tokens_path("/v1/chat/completions/count_tokens")


# ---- the official client, end to end -----------------------------------------------------------------------


def sdk_client(completion: Completion, seen: list[Conversation]) -> OpenAI:
    """An openai client whose HTTP transport is this codec answering with `completion` (strict validation)."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        try:
            conv = CODEC.decode_request(json.loads(request.content), request.url.path, {})
        except GatewayError as error:
            answer = CODEC.encode_error(error)
            return httpx2.Response(
                answer.status, content=answer.body, headers={"content-type": answer.content_type}
            )
        seen.append(conv)
        if conv.stream:
            return httpx2.Response(
                200,
                content=b"".join(CODEC.encode_stream(conv, completion)),
                headers={"content-type": "text/event-stream"},
            )
        return httpx2.Response(200, json=CODEC.encode_response(conv, completion))

    return OpenAI(
        base_url="http://gateway.test/s/run-1/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        _strict_response_validation=True,
    )


def test_sdk_client_round_trip_streamed_and_not():
    seen: list[Conversation] = []
    client = sdk_client(TOOL_ANSWER, seen)
    tools = QWEN_CODE_REQUEST["tools"]
    plain = client.chat.completions.create(model="qwen3", messages=QWEN_CODE_REQUEST["messages"], tools=tools)
    with client.chat.completions.stream(
        model="qwen3",
        messages=QWEN_CODE_REQUEST["messages"],
        tools=tools,
        stream_options={"include_usage": True},
    ) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    assert seen[0].messages == seen[1].messages and seen[1].include_usage
    for answer in (plain, streamed):
        message = answer.choices[0].message
        assert message.content == TOOL_ANSWER.content
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
            (c.name, c.arguments) for c in TOOL_ANSWER.tool_calls
        ]
        assert answer.usage.completion_tokens == 5
    assert streamed.choices[0].message.model_extra["reasoning_content"] == TOOL_ANSWER.reasoning


def test_sdk_client_sees_a_bad_request_error_for_images():
    client = sdk_client(TOOL_ANSWER, [])
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(
            model="qwen3",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
                }
            ],
        )
    assert caught.value.status_code == 400 and caught.value.type == "invalid_request_error"


# ---- robustness --------------------------------------------------------------------------------------------

_KEYS = st.sampled_from(
    [
        "model",
        "messages",
        "role",
        "content",
        "type",
        "text",
        "tool_calls",
        "id",
        "function",
        "name",
        "arguments",
        "tools",
        "parameters",
        "tool_choice",
        "stop",
        "stream",
        "stream_options",
        "include_usage",
        "max_tokens",
        "temperature",
        "n",
        "tool_call_id",
        "reasoning_content",
        "image_url",
        "user",
        "system",
        "assistant",
        "tool",
        "developer",
        "function_call",
        "functions",
        "reasoning_effort",
        "chat_template_kwargs",
        "refusal",
    ]
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=5) | _KEYS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(_KEYS | st.text(max_size=3), children, max_size=5)
    ),
    max_leaves=30,
)
_ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "other"])
_TEXT = st.text(max_size=8)
_PART = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["text", "refusal", "image_url", "other"]),
        "text": _TEXT | _JSON,
        "refusal": _TEXT,
    }
)
_CALL = st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": _TEXT, "arguments": _TEXT | _JSON})},
    optional={"id": _TEXT | _JSON, "type": st.sampled_from(["function", "custom"])},
)
# Mostly plausible values, sometimes anything: deep code paths get reached, not only the first type check.
_MESSAGE = st.fixed_dictionaries(
    {"role": _ROLES},
    optional={
        "content": st.none() | _TEXT | st.lists(_PART, max_size=3) | _JSON,
        "tool_calls": st.lists(_CALL, max_size=2) | _JSON,
        "name": _TEXT,
        "tool_call_id": _TEXT | _JSON,
        "reasoning_content": _TEXT | _JSON,
    },
)
_TOOL = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "custom", "web_search"]),
        "function": st.fixed_dictionaries(
            {"name": _TEXT}, optional={"description": _TEXT | _JSON, "parameters": _JSON}
        ),
    }
)
_BODY = _JSON | st.fixed_dictionaries(
    {"messages": st.lists(_MESSAGE, min_size=1, max_size=4)},
    optional={
        "model": _TEXT | _JSON,
        "tools": st.lists(_TOOL, max_size=2) | _JSON,
        "tool_choice": _JSON,
        "stop": _JSON,
        "stream": st.booleans() | _JSON,
        "stream_options": _JSON,
        "max_tokens": st.integers(-2, 99) | _JSON,
        "temperature": st.floats() | _JSON,
        "n": _JSON,
        "reasoning_effort": _JSON,
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_BODY)
def test_arbitrary_json_bodies_raise_only_gateway_errors(body):
    try:
        conv = CODEC.decode_request(body, "/v1/chat/completions", {})
    except GatewayError as error:
        assert error.kind == "invalid_request" and error.message
        return
    # Whatever decodes must also encode into valid answers.
    ChatCompletion.model_validate(CODEC.encode_response(conv, TOOL_ANSWER))
    stream_chunks(conv, TOOL_ANSWER)
