"""GoogleCodec: Gemini requests decode into Conversations; answers and streams parse with google-genai."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.codecs.base import GatewayError
from polar_mitm.codecs.google import GoogleCodec
from polar_mitm.conversation import Completion, Conversation, Message, Tool, ToolCall

CODEC = GoogleCodec()
CALL_PATH = "/v1beta/models/gemini-2.5-pro:generateContent"
STREAM_PATH = "/v1beta/models/gemini-2.5-pro:streamGenerateContent"

# What Gemini CLI sends on its second turn: a tool call answered, thoughts asked for, both schema dialects.
GEMINI_CLI_REQUEST: dict[str, Any] = {
    "contents": [
        {"role": "user", "parts": [{"text": "<session context>"}, {"text": "List files, then read a.py"}]},
        {
            "role": "model",
            "parts": [
                {"text": "I should list files.", "thought": True},
                {"text": "Listing "},
                {"text": "files."},
                {
                    "functionCall": {"name": "list_directory", "args": {"path": "."}},
                    "thoughtSignature": "c2ln",
                },
                {"functionCall": {"name": "read_file", "args": {"absolute_path": "/a.py"}, "id": "rf-1"}},
            ],
        },
        {
            "role": "user",
            "parts": [
                {
                    "functionResponse": {
                        "name": "read_file",
                        "id": "rf-1",
                        "response": {"output": "print('é')"},
                    }
                },
                {"functionResponse": {"name": "list_directory", "response": {"output": "a.py"}}},
                {"text": "Thanks."},
            ],
        },
    ],
    "systemInstruction": {"role": "user", "parts": [{"text": "You are Gemini CLI."}, {"text": "Be brief."}]},
    "tools": [
        {
            "functionDeclarations": [
                {
                    "name": "list_directory",
                    "description": "Lists a directory.",
                    "parameters": {
                        "type": "OBJECT",
                        "required": ["path"],
                        "properties": {
                            "path": {"type": "STRING", "description": "Directory."},
                            "ignore": {"type": "ARRAY", "items": {"type": "STRING"}, "nullable": True},
                        },
                    },
                },
                {
                    "name": "read_file",
                    "description": "Reads a file.",
                    "parametersJsonSchema": {
                        "type": "object",
                        "properties": {"absolute_path": {"type": "string"}},
                        "required": ["absolute_path"],
                    },
                },
            ]
        },
        {"googleSearch": {}},
    ],
    "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
    "generationConfig": {
        "temperature": 0.7,
        "topP": 0.95,
        "topK": 64,
        "maxOutputTokens": 1024,
        "stopSequences": ["<END>"],
        "thinkingConfig": {"includeThoughts": True, "thinkingBudget": -1},
    },
}


def completion(
    content: str = "",
    reasoning: str | None = None,
    tool_calls: list[ToolCall] | None = None,
    finish: str = "stop",
    n_prompt: int = 7,
    n_completion: int = 4,
) -> Completion:
    """A hand-built engine answer with consistent id / logprob lists."""
    return Completion(
        id="chatcmpl-abc",
        model="engine-model",
        content=content,
        reasoning=reasoning,
        tool_calls=tool_calls or [],
        finish_reason=finish,  # type: ignore[arg-type]
        prompt_ids=list(range(n_prompt)),
        completion_ids=list(range(100, 100 + n_completion)),
        completion_logprobs=[-0.5] * n_completion,
    )


def decode(body: Any, path: str = CALL_PATH, query: dict[str, str] | None = None) -> Conversation:
    return CODEC.decode_request(body, path, query or {})


def sse_payloads(frames: list[bytes]) -> list[dict[str, Any]]:
    text = b"".join(frames).decode()
    events = [event for event in text.split("\n\n") if event.strip()]
    assert all(event.startswith("data: ") for event in events)
    return [json.loads(event.removeprefix("data: ")) for event in events]


def assembled(chunks: list[types.GenerateContentResponse]) -> dict[str, Any]:
    """What a client keeps of a stream: joined text and thoughts, calls, last finish reason and usage."""
    parts = [part for chunk in chunks for part in chunk.candidates[0].content.parts]
    return {
        "text": "".join(p.text for p in parts if p.text is not None and not p.thought),
        "thoughts": "".join(p.text for p in parts if p.text is not None and p.thought),
        "calls": [p.function_call for p in parts if p.function_call],
        "finish": chunks[-1].candidates[0].finish_reason,
        "usage": chunks[-1].usage_metadata,
    }


# --- paths -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v1beta/models/gemini-2.5-pro:generateContent",
        "/v1/models/gemini-2.5-flash:streamGenerateContent",
        "/s/SESSION/v1beta/models/x:streamGenerateContent",
        "/v1beta/tunedModels/my-tune:generateContent",
        "/v1/projects/p/locations/us/publishers/google/models/gemini-2.5-pro:generateContent",
    ],
)
def test_matches_model_call_paths_under_any_prefix(path: str) -> None:
    assert CODEC.matches(path)


@pytest.mark.parametrize(
    "path",
    [
        "/v1beta/models/gemini-2.5-pro:countTokens",
        "/v1beta/models",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1beta/models/gemini-2.5-pro:generateContentX",
    ],
)
def test_does_not_match_other_paths(path: str) -> None:
    assert not CODEC.matches(path)


def test_stream_is_requested_by_method_not_body() -> None:
    assert CODEC.stream_requested({}, STREAM_PATH, {"alt": "sse"})
    assert CODEC.stream_requested({}, STREAM_PATH, {})
    assert not CODEC.stream_requested({"stream": True}, CALL_PATH, {})


def test_model_and_alt_come_from_path_and_query() -> None:
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    sse = decode(body, STREAM_PATH, {"alt": "sse"})
    array = decode(body, STREAM_PATH, {})
    plain = decode(body, "/v1beta/tunedModels/my-tune:generateContent")
    assert (sse.model, sse.stream, sse.extra["alt"]) == ("gemini-2.5-pro", True, "sse")
    assert (array.stream, array.extra["alt"]) == (True, "json")
    assert (plain.model, plain.stream) == ("tunedModels/my-tune", False)


# --- decoding --------------------------------------------------------------------------------------------


def test_decodes_gemini_cli_request() -> None:
    conv = decode(GEMINI_CLI_REQUEST)
    assert conv.messages == [
        Message(role="system", content="You are Gemini CLI.\nBe brief."),
        Message(role="user", content="<session context>\nList files, then read a.py"),
        Message(
            role="assistant",
            content="Listing files.",
            reasoning="I should list files.",
            tool_calls=[
                ToolCall(id="call_0", name="list_directory", arguments='{"path": "."}'),
                ToolCall(id="rf-1", name="read_file", arguments='{"absolute_path": "/a.py"}'),
            ],
        ),
        Message(role="tool", content='{"output": "print(\'é\')"}', tool_call_id="rf-1", name="read_file"),
        Message(role="tool", content='{"output": "a.py"}', tool_call_id="call_0", name="list_directory"),
        Message(role="user", content="Thanks."),
    ]
    assert conv.tools == [
        Tool(
            name="list_directory",
            description="Lists a directory.",
            parameters={
                "type": "object",
                "required": ["path"],
                "properties": {
                    "path": {"type": "string", "description": "Directory."},
                    "ignore": {"type": ["array", "null"], "items": {"type": "string"}},
                },
            },
        ),
        Tool(
            name="read_file",
            description="Reads a file.",
            parameters={
                "type": "object",
                "properties": {"absolute_path": {"type": "string"}},
                "required": ["absolute_path"],
            },
        ),
    ]
    assert (conv.model, conv.tool_choice, conv.thinking) == ("gemini-2.5-pro", "auto", True)
    assert (conv.max_tokens, conv.temperature, conv.top_p, conv.top_k) == (1024, 0.7, 0.95, 64)
    assert conv.stop == ["<END>"]


def test_decoded_conversation_builds_an_engine_request() -> None:
    body = decode(GEMINI_CLI_REQUEST).to_engine_request()
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert [t["function"]["name"] for t in body["tools"]] == ["list_directory", "read_file"]


def test_function_results_without_ids_pair_with_calls_by_name_in_order() -> None:
    conv = decode(
        {
            "contents": [
                {"role": "user", "parts": [{"text": "go"}]},
                {
                    "role": "model",
                    "parts": [
                        {"functionCall": {"name": "ls", "args": {"p": "a"}}},
                        {"functionCall": {"name": "ls", "args": {"p": "b"}}},
                    ],
                },
                {
                    "role": "user",
                    "parts": [
                        {"functionResponse": {"name": "ls", "response": {"output": "A"}}},
                        {"functionResponse": {"name": "ls", "response": {"output": "B"}}},
                    ],
                },
                {"role": "model", "parts": [{"functionCall": {"name": "cat"}}]},
                {"role": "function", "parts": [{"functionResponse": {"name": "cat", "response": {}}}]},
            ]
        }
    )
    calls = [c.id for m in conv.messages for c in m.tool_calls]
    results = [m.tool_call_id for m in conv.messages if m.role == "tool"]
    assert calls == results == ["call_0", "call_1", "call_2"]
    assert conv.messages[-1].content == "{}"
    assert conv.messages[4].tool_calls[0].arguments == "{}"


def test_accepts_snake_case_fields() -> None:
    conv = decode(
        {
            "contents": [
                {"role": "user", "parts": [{"text": "hi"}]},
                {"role": "model", "parts": [{"function_call": {"name": "f", "args": {"x": 1}}}]},
                {"role": "user", "parts": [{"function_response": {"name": "f", "response": {"ok": True}}}]},
            ],
            "system_instruction": {"parts": [{"text": "sys"}]},
            "tools": [
                {"function_declarations": [{"name": "f", "parameters_json_schema": {"type": "object"}}]}
            ],
            "tool_config": {"function_calling_config": {"mode": "ANY", "allowed_function_names": ["f"]}},
            "generation_config": {
                "max_output_tokens": 9,
                "top_k": 3.0,
                "stop_sequences": ["x"],
                "thinking_config": {"include_thoughts": True, "thinking_budget": 128},
            },
        }
    )
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "tool"]
    assert conv.messages[3].tool_call_id == conv.messages[2].tool_calls[0].id
    assert conv.tools == [Tool(name="f", parameters={"type": "object"})]
    assert (conv.tool_choice, conv.max_tokens, conv.top_k) == ({"name": "f"}, 9, 3)
    assert (conv.stop, conv.thinking) == (["x"], True)


@pytest.mark.parametrize(
    ("config", "choice"),
    [
        ({"mode": "AUTO"}, "auto"),
        ({"mode": "ANY"}, "required"),
        ({"mode": "NONE"}, "none"),
        ({"mode": "any", "allowedFunctionNames": ["f"]}, {"name": "f"}),
        ({"mode": "ANY", "allowedFunctionNames": ["f", "g"]}, "required"),
        ({}, "auto"),
    ],
)
def test_function_calling_mode_maps_to_tool_choice(config: dict[str, Any], choice: Any) -> None:
    body = {"contents": [{"parts": [{"text": "hi"}]}], "toolConfig": {"functionCallingConfig": config}}
    assert decode(body).tool_choice == choice


@pytest.mark.parametrize(
    ("thinking_config", "thinking"),
    [
        ({"thinkingBudget": 0}, False),
        ({"thinkingBudget": 0, "includeThoughts": True}, False),
        ({"includeThoughts": True}, True),
        ({"includeThoughts": False, "thinkingBudget": 512}, None),
        ({}, None),
    ],
)
def test_thinking_config_maps_to_thinking(thinking_config: dict[str, Any], thinking: bool | None) -> None:
    body = {
        "contents": [{"parts": [{"text": "hi"}]}],
        "generationConfig": {"thinkingConfig": thinking_config},
    }
    assert decode(body).thinking is thinking


def test_request_without_generation_config_uses_defaults() -> None:
    conv = decode({"contents": [{"parts": [{"text": "hi"}]}]})
    assert conv.messages == [Message(role="user", content="hi")]
    assert (conv.max_tokens, conv.thinking, conv.tool_choice, conv.tools) == (None, None, None, [])


@pytest.mark.parametrize(
    "part",
    [
        {"inlineData": {"mimeType": "image/png", "data": "AAAA"}},
        {"inline_data": {"mime_type": "image/png", "data": "AAAA"}},
        {"fileData": {"mimeType": "application/pdf", "fileUri": "gs://x"}},
    ],
)
def test_images_and_files_are_rejected(part: dict[str, Any]) -> None:
    with pytest.raises(GatewayError, match="not supported") as caught:
        decode({"contents": [{"role": "user", "parts": [{"text": "look"}, part]}]})
    assert caught.value.kind == "invalid_request"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ([], "JSON object"),
        ({}, "contents must not be empty"),
        ({"contents": "hi"}, "contents must be a list"),
        ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, "role"),
        ({"contents": [{"parts": [{"text": 3}]}]}, "text must be a string"),
        ({"contents": [{"parts": [{"functionCall": {"args": {}}}]}]}, "functionCall parts belong in a model"),
        ({"contents": [{"role": "model", "parts": [{"functionCall": {"args": {}}}]}]}, "functionCall.name"),
        ({"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": [1]}}]}]}, "args"),
        (
            {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"candidateCount": 2}},
            "candidateCount",
        ),
        (
            {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"temperature": "hot"}},
            "temperature",
        ),
        ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"topK": 1.5}}, "topK"),
        (
            {
                "contents": [{"parts": [{"text": "x"}]}],
                "toolConfig": {"functionCallingConfig": {"mode": "SOME"}},
            },
            "mode",
        ),
        (
            {
                "contents": [{"parts": [{"text": "x"}]}],
                "tools": [{"functionDeclarations": [{"description": "d"}]}],
            },
            "name is required",
        ),
        ({"contents": [{"parts": [{"text": "x"}]}], "cachedContent": "cachedContents/1"}, "cachedContent"),
    ],
)
def test_malformed_requests_raise_invalid_request(body: Any, fragment: str) -> None:
    with pytest.raises(GatewayError, match=fragment) as caught:
        decode(body)
    assert caught.value.kind == "invalid_request"


# --- encoding --------------------------------------------------------------------------------------------


def thinking_conv(path: str = CALL_PATH, query: dict[str, str] | None = None) -> Conversation:
    return decode(GEMINI_CLI_REQUEST, path, query)


def test_encodes_text_answer_as_generate_content_response() -> None:
    answer = CODEC.encode_response(thinking_conv(), completion("Hello there.", reasoning="Greet them."))
    response = types.GenerateContentResponse.model_validate(answer)
    parts = response.candidates[0].content.parts
    assert [(p.text, p.thought) for p in parts] == [("Greet them.", True), ("Hello there.", None)]
    assert response.text == "Hello there."
    assert response.candidates[0].finish_reason == types.FinishReason.STOP
    assert response.usage_metadata.prompt_token_count == 7
    assert response.usage_metadata.candidates_token_count == 4
    assert response.usage_metadata.total_token_count == 11
    assert (response.model_version, response.response_id) == ("gemini-2.5-pro", "chatcmpl-abc")


def test_reasoning_is_hidden_unless_thoughts_were_requested() -> None:
    conv = decode({"contents": [{"parts": [{"text": "hi"}]}]})
    answer = CODEC.encode_response(conv, completion("Hi.", reasoning="secret"))
    assert answer["candidates"][0]["content"]["parts"] == [{"text": "Hi."}]


def test_encodes_function_calls_with_stop() -> None:
    calls = [ToolCall("call_a", "read_file", '{"absolute_path": "/a.py"}'), ToolCall("call_b", "ls", "")]
    answer = CODEC.encode_response(
        thinking_conv(), completion("Reading.", tool_calls=calls, finish="tool_calls")
    )
    response = types.GenerateContentResponse.model_validate(answer)
    assert [(c.id, c.name, c.args) for c in response.function_calls] == [
        ("call_a", "read_file", {"absolute_path": "/a.py"}),
        ("call_b", "ls", {}),
    ]
    assert response.candidates[0].finish_reason == types.FinishReason.STOP


def test_non_object_arguments_are_kept_raw() -> None:
    answer = CODEC.encode_response(thinking_conv(), completion(tool_calls=[ToolCall("c", "f", "[1, 2")]))
    assert answer["candidates"][0]["content"]["parts"] == [
        {"functionCall": {"name": "f", "args": {"_raw": "[1, 2"}, "id": "c"}}
    ]


@pytest.mark.parametrize(
    ("finish", "reason"),
    [("stop", "STOP"), ("tool_calls", "STOP"), ("length", "MAX_TOKENS"), ("abort", "OTHER")],
)
def test_finish_reasons(finish: str, reason: str) -> None:
    answer = CODEC.encode_response(thinking_conv(), completion("x", finish=finish))
    assert answer["candidates"][0]["finishReason"] == reason


def test_empty_answer_still_has_a_part() -> None:
    response = types.GenerateContentResponse.model_validate(
        CODEC.encode_response(thinking_conv(), completion(""))
    )
    assert response.text == ""


STREAM_CASES = [
    completion("A long answer " * 30, reasoning="Think " * 40),
    completion(
        "Reading both.",
        tool_calls=[
            ToolCall("c1", "read_file", '{"absolute_path": "/a"}'),
            ToolCall("c2", "read_file", '{"absolute_path": "/b"}'),
        ],
        finish="tool_calls",
    ),
    completion("Cut", finish="length"),
    completion(""),
]


@pytest.mark.parametrize("answer", STREAM_CASES)
def test_sse_stream_assembles_to_the_plain_response(answer: Completion) -> None:
    conv = thinking_conv(STREAM_PATH, {"alt": "sse"})
    payloads = sse_payloads(list(CODEC.encode_stream(conv, answer)))
    chunks = [types.GenerateContentResponse.model_validate(c) for c in payloads]
    plain = types.GenerateContentResponse.model_validate(CODEC.encode_response(conv, answer))
    assert assembled(chunks) == assembled([plain])
    assert all(c.candidates[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage_metadata is None for c in chunks[:-1])


def test_sse_stream_splits_text_and_sends_calls_whole() -> None:
    conv = thinking_conv(STREAM_PATH, {"alt": "sse"})
    payloads = sse_payloads(list(CODEC.encode_stream(conv, STREAM_CASES[0])))
    kinds = [
        ["thought" if p.get("thought") else "text" for p in c["candidates"][0]["content"]["parts"]]
        for c in payloads
    ]
    assert len(payloads) > 4 and all(len(k) == 1 for k in kinds)
    assert kinds.index(["text"]) > 0 and ["thought"] not in kinds[kinds.index(["text"]) :]
    call_payloads = sse_payloads(list(CODEC.encode_stream(conv, STREAM_CASES[1])))
    assert [len(c["candidates"][0]["content"]["parts"]) for c in call_payloads] == [1, 2]


def test_stream_without_alt_sse_is_a_json_array() -> None:
    conv = thinking_conv(STREAM_PATH, {})
    frames = list(CODEC.encode_stream(conv, STREAM_CASES[1]))
    body = json.loads(b"".join(frames))
    assert isinstance(body, list) and len(body) == len(frames) - 1
    chunks = [types.GenerateContentResponse.model_validate(c) for c in body]
    plain = types.GenerateContentResponse.model_validate(CODEC.encode_response(conv, STREAM_CASES[1]))
    assert assembled(chunks) == assembled([plain])


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_streamed_text_joins_back_exactly(text: str) -> None:
    conv = thinking_conv(STREAM_PATH, {"alt": "sse"})
    payloads = sse_payloads(list(CODEC.encode_stream(conv, completion(text))))
    assert "".join(p["text"] for c in payloads for p in c["candidates"][0]["content"]["parts"]) == text


@pytest.mark.parametrize(
    ("kind", "code", "status"),
    [
        ("invalid_request", 400, "INVALID_ARGUMENT"),
        ("context_length", 400, "INVALID_ARGUMENT"),
        ("not_found", 404, "NOT_FOUND"),
        ("overloaded", 503, "UNAVAILABLE"),
        ("engine_error", 500, "INTERNAL"),
    ],
)
def test_error_shapes(kind: str, code: int, status: str) -> None:
    answer = CODEC.encode_error(GatewayError(kind, "went wrong"))  # type: ignore[arg-type]
    assert answer.status == code
    assert json.loads(answer.body) == {"error": {"code": code, "message": "went wrong", "status": status}}


# --- auxiliary endpoints ---------------------------------------------------------------------------------


def test_count_tokens_paths_and_bodies() -> None:
    path = "/v1beta/models/gemini-2.5-pro:countTokens"
    assert CODEC.count_tokens_path(path) and not CODEC.count_tokens_path(CALL_PATH)
    plain = CODEC.decode_count_tokens({"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}, path, {})
    assert plain.messages == [Message(role="user", content="hi")] and plain.model == "gemini-2.5-pro"
    wrapped = CODEC.decode_count_tokens(
        {
            "generateContentRequest": {
                "model": "models/gemini-2.5-pro",
                **{k: GEMINI_CLI_REQUEST[k] for k in ("contents", "systemInstruction", "tools")},
            }
        },
        path,
        {},
    )
    assert wrapped.messages == decode(GEMINI_CLI_REQUEST).messages
    assert wrapped.tools == decode(GEMINI_CLI_REQUEST).tools
    counted = types.CountTokensResponse.model_validate(CODEC.encode_count_tokens(42))
    assert counted.total_tokens == 42


def test_models_paths_and_shapes() -> None:
    assert CODEC.models_path("/v1beta/models", "GET") and CODEC.models_path("/v1beta/models/m1", "get")
    assert not CODEC.models_path("/v1beta/models", "POST") and not CODEC.models_path(CALL_PATH, "GET")
    listing = CODEC.encode_models(["m1", "m2"], "/v1beta/models")
    assert [m["name"] for m in listing["models"]] == ["models/m1", "models/m2"]
    single = CODEC.encode_models(["m1"], "/v1beta/models/m1")
    assert single == listing["models"][0]
    assert "generateContent" in single["supportedGenerationMethods"]


# --- the official SDK as the harness ---------------------------------------------------------------------


def scripted_gateway(answer: Completion, seen: list[Conversation]) -> httpx.MockTransport:
    """An in-process stand-in for the gateway: the codec answers every request with `answer`."""

    def handle(request: httpx.Request) -> httpx.Response:
        path, query = request.url.path, dict(request.url.params)
        body = json.loads(request.content) if request.content else None
        try:
            if CODEC.count_tokens_path(path):
                seen.append(CODEC.decode_count_tokens(body, path, query))
                return httpx.Response(200, json=CODEC.encode_count_tokens(len(seen[-1].messages)))
            if CODEC.models_path(path, request.method):
                return httpx.Response(200, json=CODEC.encode_models(["polar-model"], path))
            conv = CODEC.decode_request(body, path, query)
        except GatewayError as error:
            failed = CODEC.encode_error(error)
            return httpx.Response(
                failed.status, content=failed.body, headers={"content-type": failed.content_type}
            )
        seen.append(conv)
        if conv.stream:
            return httpx.Response(
                200,
                content=b"".join(CODEC.encode_stream(conv, answer)),
                headers={"content-type": "text/event-stream"},
            )
        return httpx.Response(200, json=CODEC.encode_response(conv, answer))

    return httpx.MockTransport(handle)


def sdk_client(answer: Completion, seen: list[Conversation]) -> genai.Client:
    http = httpx.Client(transport=scripted_gateway(answer, seen))
    return genai.Client(api_key="test-key", http_options=types.HttpOptions(httpx_client=http))


SDK_CONFIG = types.GenerateContentConfig(
    system_instruction="Be brief.",
    tools=[
        types.Tool(
            function_declarations=[
                types.FunctionDeclaration(
                    name="read_file",
                    description="Reads a file.",
                    parameters=types.Schema(
                        type=types.Type.OBJECT,
                        required=["path"],
                        properties={"path": types.Schema(type=types.Type.STRING)},
                    ),
                )
            ]
        )
    ],
    thinking_config=types.ThinkingConfig(include_thoughts=True, thinking_budget=256),
    automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    max_output_tokens=64,
)
SDK_ANSWER = completion(
    "Reading it now.",
    reasoning="Need the file.",
    tool_calls=[ToolCall("c1", "read_file", '{"path": "a.py"}')],
    finish="tool_calls",
)


def test_sdk_generate_content_round_trip() -> None:
    seen: list[Conversation] = []
    response = sdk_client(SDK_ANSWER, seen).models.generate_content(
        model="gemini-2.5-pro", contents="Read a.py", config=SDK_CONFIG
    )
    assert seen[0].messages == [
        Message(role="system", content="Be brief."),
        Message(role="user", content="Read a.py"),
    ]
    assert seen[0].tools[0].parameters["properties"] == {"path": {"type": "string"}}
    assert (seen[0].thinking, seen[0].max_tokens, seen[0].model) == (True, 64, "gemini-2.5-pro")
    assert response.function_calls[0].args == {"path": "a.py"}
    assert response.candidates[0].content.parts[0].thought is True
    assert response.usage_metadata.total_token_count == 11


def test_sdk_stream_round_trip_matches_plain_answer() -> None:
    seen: list[Conversation] = []
    client = sdk_client(SDK_ANSWER, seen)
    chunks = list(
        client.models.generate_content_stream(model="gemini-2.5-pro", contents="Read a.py", config=SDK_CONFIG)
    )
    plain = client.models.generate_content(model="gemini-2.5-pro", contents="Read a.py", config=SDK_CONFIG)
    assert seen[0].stream and seen[0].extra["alt"] == "sse"
    assert assembled(chunks) == assembled([plain])


def test_sdk_sees_errors_in_google_shape() -> None:
    with pytest.raises(genai_errors.ClientError) as caught:
        sdk_client(SDK_ANSWER, []).models.generate_content(
            model="gemini-2.5-pro", contents=types.Part.from_bytes(data=b"\x89PNG", mime_type="image/png")
        )
    assert (caught.value.code, caught.value.status) == (400, "INVALID_ARGUMENT")
    assert "not supported" in caught.value.message


def test_sdk_count_tokens_and_models() -> None:
    seen: list[Conversation] = []
    client = sdk_client(SDK_ANSWER, seen)
    assert client.models.count_tokens(model="gemini-2.5-pro", contents="one two").total_tokens == 1
    model = client.models.get(model="polar-model")
    assert (model.name, model.input_token_limit) == ("models/polar-model", CODEC.input_token_limit)
    assert "generateContent" in model.supported_actions
    assert [m.name for m in client.models.list()] == ["models/polar-model"]


# --- robustness ------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually the valid shape, sometimes any JSON at all in its place."""
    return st.sampled_from([True] * 7 + [False]).flatmap(lambda keep: valid if keep else json_values)


def obj(
    required: dict[str, st.SearchStrategy[Any]] | None = None, **optional: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    return maybe(st.fixed_dictionaries(required or {}, optional=optional))


names = st.sampled_from(["f", "g", ""])
schema = st.recursive(
    obj(type=maybe(st.sampled_from(["OBJECT", "STRING", "TYPE_UNSPECIFIED"])), nullable=maybe(st.booleans())),
    lambda inner: obj(
        type=st.just("OBJECT"),
        properties=maybe(st.dictionaries(names, inner, max_size=2)),
        items=inner,
        anyOf=maybe(st.lists(inner, max_size=2)),
    ),
    max_leaves=6,
)
part = obj(
    text=maybe(st.text(max_size=5)),
    thought=maybe(st.booleans()),
    thoughtSignature=st.text(max_size=3),
    functionCall=obj(name=maybe(names), args=maybe(st.dictionaries(names, json_values)), id=maybe(names)),
    functionResponse=obj(
        name=maybe(names),
        response=maybe(st.dictionaries(names, json_values)),
        id=maybe(names),
        parts=json_values,
    ),
)
content = obj(
    {"parts": maybe(st.lists(part, min_size=1, max_size=4))},
    role=maybe(st.sampled_from(["user", "model", "function", "system"])),
)
request = obj(
    {"contents": maybe(st.lists(content, min_size=1, max_size=4))},
    systemInstruction=maybe(st.text(max_size=5) | obj(parts=maybe(st.lists(part, max_size=2)))),
    tools=maybe(
        st.lists(
            obj(
                functionDeclarations=maybe(
                    st.lists(
                        obj(
                            name=maybe(names),
                            description=maybe(st.text(max_size=3)),
                            parameters=schema,
                            parametersJsonSchema=json_values,
                        ),
                        max_size=2,
                    )
                )
            ),
            max_size=2,
        )
    ),
    toolConfig=obj(
        functionCallingConfig=obj(
            mode=maybe(st.sampled_from(["AUTO", "ANY", "NONE", "x"])),
            allowedFunctionNames=maybe(st.lists(names, max_size=2)),
        )
    ),
    generationConfig=obj(
        maxOutputTokens=json_values,
        temperature=json_values,
        topP=json_values,
        topK=json_values,
        candidateCount=json_values,
        stopSequences=maybe(st.lists(st.text(max_size=3), max_size=2)),
        thinkingConfig=obj(thinkingBudget=maybe(st.integers(-1, 10)), includeThoughts=maybe(st.booleans())),
    ),
)
gemini_like = st.one_of(request, request, request, obj(generateContentRequest=request))


def only_gateway_errors(body: Any) -> None:
    for run in (
        lambda: decode(body, STREAM_PATH, {"alt": "sse"}),
        lambda: CODEC.decode_count_tokens(body, "/v1beta/models/m:countTokens", {}),
    ):
        try:
            run()
        except GatewayError as error:
            assert error.kind == "invalid_request"


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_arbitrary_json_raises_only_gateway_errors(body: Any) -> None:
    only_gateway_errors(body)


@settings(max_examples=500, deadline=None)
@given(gemini_like)
def test_gemini_shaped_json_raises_only_gateway_errors(body: Any) -> None:
    only_gateway_errors(body)


def test_response_json_schema_with_sdk_type_names_becomes_plain_json_schema() -> None:
    """Gemini CLI's side requests send @google/genai's upper-case Type names inside responseJsonSchema."""
    body = {
        "contents": [{"role": "user", "parts": [{"text": "who speaks next?"}]}],
        "generationConfig": {
            "responseMimeType": "application/json",
            "responseJsonSchema": {
                "type": "OBJECT",
                "properties": {
                    "next_speaker": {"type": "STRING", "enum": ["user", "model"]},
                    "tags": {"type": "ARRAY", "items": {"type": "STRING"}},
                    "type": {"type": "STRING"},
                },
                "required": ["next_speaker"],
            },
        },
    }
    schema = decode(body).response_format["json_schema"]["schema"]
    assert schema["type"] == "object"
    assert schema["properties"]["next_speaker"] == {"type": "string", "enum": ["user", "model"]}
    assert schema["properties"]["tags"] == {"type": "array", "items": {"type": "string"}}
    assert schema["properties"]["type"] == {"type": "string"}  # a property named "type" is left as it is
