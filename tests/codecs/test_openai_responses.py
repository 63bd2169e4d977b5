"""The Responses codec: Codex-shaped requests fold into the right chat turns, and every answer it writes is
accepted by the official openai SDK types (Response, the ResponseStreamEvent union) and by the SDK client."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import BadRequestError, OpenAI
from openai._streaming import SSEDecoder
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from polar_mitm.codecs.base import GatewayError
from polar_mitm.codecs.openai_responses import OpenAIResponsesCodec
from polar_mitm.conversation import Completion, Conversation, Message, Tool, ToolCall

CODEC = OpenAIResponsesCodec()
EVENT = TypeAdapter(ResponseStreamEvent)

SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "additionalProperties": False,
        "required": ["command"],
        "properties": {
            "command": {"type": "array", "items": {"type": "string"}},
            "workdir": {"type": "string"},
            "timeout_ms": {"type": "number"},
        },
    },
}
PATCH_GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use `apply_patch` to edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}
PERMISSIONS = "<permissions instructions>sandbox: workspace-write</permissions instructions>"
PATCH = "*** Begin Patch\n*** Update File: calc.py\n@@\n-    return a - b\n+    return a + b\n*** End Patch"
SHELL_ARGS = '{"command":["bash","-lc","pytest -q"],"workdir":"/repo"}'
SHELL_OUTPUT = '{"output":"F.\\n1 failed","metadata":{"exit_code":1,"duration_seconds":0.4}}'


def text_message(role: str, text: str, part: str = "input_text") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


# Shaped like a Codex CLI (wire_api = "responses") request on its third turn.
CODEX_REQUEST: dict[str, Any] = {
    "model": "gpt-5-codex",
    "instructions": "You are Codex, a coding agent running in the Codex CLI.",
    "input": [
        text_message("developer", PERMISSIONS),
        text_message("user", "<environment_context>\n  <cwd>/repo</cwd>\n</environment_context>"),
        text_message("user", "Fix the failing test in calc.py"),
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "**Running tests**"}],
            "content": None,
            "encrypted_content": "gAAAAABopaque-from-another-server==",
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "name": "shell",
            "arguments": SHELL_ARGS,
            "call_id": "call_sh",
        },
        {"type": "function_call_output", "call_id": "call_sh", "output": SHELL_OUTPUT},
        {
            "type": "custom_tool_call",
            "id": "ctc_1",
            "status": "completed",
            "call_id": "call_patch",
            "name": "apply_patch",
            "input": PATCH,
        },
        {
            "type": "custom_tool_call_output",
            "call_id": "call_patch",
            "output": "Success. Updated the following files:\nM calc.py\n",
        },
    ],
    "tools": [SHELL_TOOL, PATCH_TOOL, {"type": "web_search"}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199c3aa-5f0e-7c31-b9a4-6f1f4a8b2d10",
    "text": {"verbosity": "medium"},
}


def make_completion(
    content: str = "",
    reasoning: str | None = None,
    tool_calls: list[ToolCall] | None = None,
    finish_reason: str = "stop",
    n_prompt: int = 40,
    n_completion: int = 7,
) -> Completion:
    return Completion(
        id="0b5c2d9e41f8",
        model="engine-model",
        content=content,
        reasoning=reasoning,
        tool_calls=tool_calls or [],
        finish_reason=finish_reason,  # type: ignore[arg-type]
        prompt_ids=list(range(n_prompt)),
        completion_ids=list(range(500, 500 + n_completion)),
        completion_logprobs=[-0.25] * n_completion,
    )


FULL_ANSWER = make_completion(
    content="The subtraction was the bug; I will patch it and rerun the tests to be sure.",
    reasoning="calc.add subtracts instead of adding.\n\nPatch it, then run pytest again to confirm the fix.",
    tool_calls=[
        ToolCall("call_a1", "apply_patch", json.dumps({"input": PATCH})),
        ToolCall("call_a2", "shell", '{"command": ["bash", "-lc", "pytest -q tests/test_calc.py"]}'),
    ],
    finish_reason="tool_calls",
)


def decode(body: dict[str, Any]) -> Conversation:
    return CODEC.decode_request(body, "/v1/responses", {})


def conversation(**fields: Any) -> Conversation:
    return decode({"model": "m", "input": "hi", **fields})


def stream_events(conv: Conversation, completion: Completion) -> list[tuple[str | None, dict[str, Any]]]:
    """(SSE event name, payload) pairs, parsed by the openai SDK's own SSE decoder."""
    return [
        (event.event, json.loads(event.data))
        for event in SSEDecoder().iter_bytes(iter(list(CODEC.encode_stream(conv, completion))))
    ]


def without_times(response: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in response.items() if k not in ("created_at", "completed_at")}


# ---- paths -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v1/responses", "/s/SESSION/v1/responses", "/api/v1/responses", "/responses", "/v1/responses/"]
)
def test_matches_responses_under_any_prefix(path):
    assert CODEC.matches(path)


@pytest.mark.parametrize(
    "path", ["/v1/responses/resp_123", "/v1/responses/compact", "/v1/chat/completions", "/v1/messages"]
)
def test_does_not_match_subpaths_or_other_endpoints(path):
    assert not CODEC.matches(path)


# ---- decoding ----------------------------------------------------------------------------------------------


def test_codex_request_decodes_into_chat_turns():
    conv = decode(CODEX_REQUEST)
    assert conv.messages == [
        Message(role="system", content="You are Codex, a coding agent running in the Codex CLI."),
        Message(role="system", content=PERMISSIONS),
        Message(role="user", content="<environment_context>\n  <cwd>/repo</cwd>\n</environment_context>"),
        Message(role="user", content="Fix the failing test in calc.py"),
        Message(
            role="assistant",
            reasoning="**Running tests**",
            tool_calls=[ToolCall("call_sh", "shell", SHELL_ARGS)],
        ),
        Message(role="tool", content=SHELL_OUTPUT, tool_call_id="call_sh", name="shell"),
        Message(
            role="assistant", tool_calls=[ToolCall("call_patch", "apply_patch", json.dumps({"input": PATCH}))]
        ),
        Message(
            role="tool",
            content="Success. Updated the following files:\nM calc.py\n",
            tool_call_id="call_patch",
            name="apply_patch",
        ),
    ]
    shell, patch = conv.tools
    assert shell == Tool("shell", SHELL_TOOL["description"], SHELL_TOOL["parameters"])
    assert (patch.name, patch.description) == ("apply_patch", "Use `apply_patch` to edit files.")
    assert patch.parameters["properties"]["input"]["type"] == "string"
    assert PATCH_GRAMMAR in patch.parameters["properties"]["input"]["description"]
    assert patch.parameters["required"] == ["input"]
    assert (conv.model, conv.tool_choice, conv.thinking, conv.stream) == ("gpt-5-codex", "auto", True, True)
    assert conv.extra["store"] is False and conv.extra["include"] == ["reasoning.encrypted_content"]
    assert conv.extra["parallel_tool_calls"] is False and conv.extra["custom_tools"] == ["apply_patch"]
    assert conv.extra["prompt_cache_key"] == CODEX_REQUEST["prompt_cache_key"]


def test_string_input_is_one_user_message_after_instructions():
    conv = decode(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": "hello",
            "max_output_tokens": 128,
            "temperature": 0.2,
            "top_p": 0.9,
        }
    )
    assert conv.messages == [
        Message(role="system", content="Be brief."),
        Message(role="user", content="hello"),
    ]
    assert (conv.max_tokens, conv.temperature, conv.top_p, conv.stream) == (128, 0.2, 0.9, False)


def test_reasoning_message_and_calls_of_one_turn_merge_into_one_assistant_message():
    conv = decode(
        {
            "model": "m",
            "input": [
                text_message("user", "go"),
                {
                    "type": "reasoning",
                    "summary": [
                        {"type": "summary_text", "text": "First part."},
                        {"type": "summary_text", "text": "Second part."},
                    ],
                },
                text_message("assistant", "Running both.", part="output_text"),
                {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "shell",
                    "arguments": '{"command": ["ls"]}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [
                        {"type": "input_text", "text": "a.py\n"},
                        {"type": "input_text", "text": "b.py\n"},
                    ],
                },
            ],
        }
    )
    assert conv.messages[1:] == [
        Message(
            role="assistant",
            content="Running both.",
            reasoning="First part.\n\nSecond part.",
            tool_calls=[ToolCall("c1", "shell", "{}"), ToolCall("c2", "shell", '{"command": ["ls"]}')],
        ),
        Message(role="tool", content="ok", tool_call_id="c1", name="shell"),
        Message(role="tool", content="a.py\nb.py\n", tool_call_id="c2", name="shell"),
    ]


def test_reasoning_with_no_assistant_turn_after_it_is_dropped_and_unknown_items_ignored():
    conv = decode(
        {
            "model": "m",
            "input": [
                text_message("user", "hi"),
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "orphan"}]},
                {
                    "type": "web_search_call",
                    "id": "ws_1",
                    "status": "completed",
                    "action": {"type": "search"},
                },
                {"role": "user", "content": "still there?"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yes"}]},
            ],
        }
    )
    assert conv.messages == [
        Message(role="user", content="hi"),
        Message(role="user", content="still there?"),
        Message(role="assistant", content="yes"),
    ]


def test_local_shell_calls_become_tool_calls():
    conv = decode(
        {
            "model": "m",
            "input": [
                text_message("user", "list"),
                {
                    "type": "local_shell_call",
                    "id": "lsh_1",
                    "call_id": "call_l",
                    "status": "completed",
                    "action": {"type": "exec", "command": ["ls"], "env": {}},
                },
                {"type": "local_shell_call_output", "id": "call_l", "output": "a.py"},
            ],
        }
    )
    call = conv.messages[1].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments)["command"]) == ("call_l", "local_shell", ["ls"])
    assert conv.messages[2] == Message(role="tool", content="a.py", tool_call_id="call_l", name="local_shell")


@pytest.mark.parametrize(
    ("effort", "thinking"),
    [("high", True), ("medium", True), ("low", True), ("minimal", False), ("none", False), (None, None)],
)
def test_reasoning_effort_sets_thinking(effort, thinking):
    assert conversation(reasoning={"effort": effort, "summary": "auto"}).thinking is thinking


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "name": "shell"}, {"name": "shell"}),
        ({"type": "custom", "name": "apply_patch"}, {"name": "apply_patch"}),
        ({"type": "allowed_tools", "mode": "required", "tools": []}, "required"),
        ({"type": "web_search_preview"}, "auto"),
    ],
)
def test_tool_choice_is_normalised(choice, expected):
    assert conversation(tool_choice=choice).tool_choice == expected


def test_previous_response_id_is_refused_only_when_set():
    with pytest.raises(GatewayError, match="previous_response_id is not supported; send the full input"):
        conversation(previous_response_id="resp_abc")
    assert conversation(previous_response_id="").messages == [Message(role="user", content="hi")]
    assert conversation(previous_response_id=None).messages == [Message(role="user", content="hi")]


@pytest.mark.parametrize(
    "item",
    [
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]},
        {
            "type": "function_call_output",
            "call_id": "c",
            "output": [{"type": "input_image", "image_url": "https://example.com/x.png"}],
        },
    ],
)
def test_images_and_files_are_rejected_as_invalid_requests(item):
    with pytest.raises(GatewayError) as caught:
        decode({"model": "m", "input": [text_message("user", "look"), item]})
    assert caught.value.kind == "invalid_request"
    assert "not supported" in caught.value.message and "images" in caught.value.message


@pytest.mark.parametrize(
    "body",
    [
        [],
        "hello",
        {"model": "m"},
        {"model": "m", "input": []},
        {"model": "m", "input": 42},
        {"model": "m", "input": [{"role": "wizard", "content": "x"}]},
        {"model": "m", "input": [{"type": "message"}]},
        {"model": "m", "input": ["hi"]},
        {"model": "m", "input": [{"type": 3}]},
        {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        {"model": "m", "input": [{"type": "function_call_output", "call_id": "c"}]},
        {"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]},
        {
            "model": "m",
            "input": [
                {"type": "reasoning", "summary": [{"type": "summary_text"}]},
                text_message("assistant", "x"),
            ],
        },
        {"model": "m", "input": "x", "instructions": ["not", "a", "string"]},
        {"model": "m", "input": "x", "max_output_tokens": "many"},
        {"model": "m", "input": "x", "tools": [{"type": "function"}]},
        {"model": "m", "input": "x", "tool_choice": "sometimes"},
        {"model": "m", "input": "x", "reasoning": "high"},
        {"model": "m", "input": "x", "include": [1]},
        {"model": "m", "input": "x", "store": "no"},
        {"model": "m", "input": "x", "previous_response_id": 12},
    ],
)
def test_malformed_requests_raise_invalid_request(body):
    with pytest.raises(GatewayError) as caught:
        CODEC.decode_request(body, "/v1/responses", {})
    assert caught.value.kind == "invalid_request"


# ---- non-streaming answers ---------------------------------------------------------------------------------


def test_response_validates_and_lists_reasoning_message_and_calls():
    conv = decode(CODEX_REQUEST)
    response = Response.model_validate(CODEC.encode_response(conv, FULL_ANSWER))
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed"
    assert response.model == "gpt-5-codex" and response.error is None and response.incomplete_details is None
    reasoning, message, patch, shell = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [s.text for s in reasoning.summary] == [FULL_ANSWER.reasoning]
    assert reasoning.encrypted_content  # asked for through `include`
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    assert response.output_text == FULL_ANSWER.content
    assert message.content[0].annotations == [] and message.content[0].logprobs == []
    assert (patch.type, patch.call_id, patch.name, patch.input) == (
        "custom_tool_call",
        "call_a1",
        "apply_patch",
        PATCH,
    )
    assert (shell.type, shell.call_id, shell.name, shell.arguments, shell.status) == (
        "function_call",
        "call_a2",
        "shell",
        FULL_ANSWER.tool_calls[1].arguments,
        "completed",
    )
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (40, 7, 47)
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_response_echoes_the_request_settings():
    conv = decode(CODEX_REQUEST)
    response = Response.model_validate(CODEC.encode_response(conv, FULL_ANSWER))
    assert response.instructions == CODEX_REQUEST["instructions"]
    # Only the tools this gateway serves: hosted ones (web_search) are not offered to the model.
    served = [(tool.type, tool.name) for tool in response.tools]
    assert served == [("function", "shell"), ("custom", "apply_patch")]
    assert response.tools[1].format.definition == PATCH_GRAMMAR
    assert response.tool_choice == "auto" and response.parallel_tool_calls is False
    assert response.store is False
    assert response.prompt_cache_key == CODEX_REQUEST["prompt_cache_key"]
    assert (response.reasoning.effort, response.reasoning.summary) == ("medium", "auto")
    assert response.text.verbosity == "medium"


def test_named_tool_choice_and_json_format_are_echoed_as_served():
    conv = decode(
        {
            **CODEX_REQUEST,
            "tool_choice": {"type": "custom", "name": "apply_patch"},
            "text": {"format": {"type": "json_object"}, "verbosity": "low"},
        }
    )
    response = Response.model_validate(CODEC.encode_response(conv, FULL_ANSWER))
    assert (response.tool_choice.type, response.tool_choice.name) == ("custom", "apply_patch")
    # The engine's output is not schema-constrained, so the echo says plain text.
    assert (response.text.format.type, response.text.verbosity) == ("text", "low")


def test_encrypted_content_only_when_included():
    conv = conversation()
    item = CODEC.encode_response(conv, make_completion("x", reasoning="because"))["output"][0]
    assert item["type"] == "reasoning" and "encrypted_content" not in item


def test_length_finish_makes_an_incomplete_response():
    response = Response.model_validate(
        CODEC.encode_response(conversation(), make_completion("cut sho", finish_reason="length"))
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def test_only_tool_calls_give_no_message_and_nothing_gives_an_empty_message():
    calls_only = CODEC.encode_response(
        conversation(), make_completion(tool_calls=[ToolCall("c", "f", "{}")], finish_reason="tool_calls")
    )
    assert [item["type"] for item in calls_only["output"]] == ["function_call"]
    empty = Response.model_validate(CODEC.encode_response(conversation(), make_completion()))
    assert [item.type for item in empty.output] == ["message"] and empty.output_text == ""


@pytest.mark.parametrize("include", [["reasoning.encrypted_content"], []])
def test_answer_items_sent_back_as_input_decode_to_the_same_assistant_turn(include):
    """Codex replays our output items in its next request: the turn the model wrote must come back intact."""
    request = {**CODEX_REQUEST, "include": include}
    output = CODEC.encode_response(decode(request), FULL_ANSWER)["output"]
    outputs = [
        {"type": "custom_tool_call_output", "call_id": "call_a1", "output": "Success."},
        {"type": "function_call_output", "call_id": "call_a2", "output": "1 passed"},
    ]
    replayed = decode({**request, "input": [*request["input"], *output, *outputs]})
    assistant, patch_result, shell_result = replayed.messages[-3:]
    assert assistant == Message(
        role="assistant",
        content=FULL_ANSWER.content,
        reasoning=FULL_ANSWER.reasoning,
        tool_calls=FULL_ANSWER.tool_calls,
    )
    assert (patch_result.name, shell_result.name) == ("apply_patch", "shell")


def test_sealed_reasoning_wins_over_an_edited_summary():
    output = CODEC.encode_response(decode(CODEX_REQUEST), FULL_ANSWER)["output"]
    output[0]["summary"] = [{"type": "summary_text", "text": "trimmed by the harness"}]
    replayed = decode({**CODEX_REQUEST, "input": [text_message("user", "go"), *output]})
    assert replayed.messages[-1].reasoning == FULL_ANSWER.reasoning


# ---- streaming ---------------------------------------------------------------------------------------------


def test_every_stream_event_validates_and_is_numbered_in_order():
    events = stream_events(decode(CODEX_REQUEST), FULL_ANSWER)
    for name, payload in events:
        assert name == payload["type"]
        EVENT.validate_python(payload)
    assert [payload["sequence_number"] for _, payload in events] == list(range(len(events)))
    types = [name for name, _ in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []


def test_stream_event_order_per_item():
    types = [name for name, _ in stream_events(decode(CODEX_REQUEST), FULL_ANSWER)]
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]  # one entry per run of deltas
    assert collapsed == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_stream_assembles_to_the_non_streamed_response():
    conv = decode(CODEX_REQUEST)
    events = [payload for _, payload in stream_events(conv, FULL_ANSWER)]
    final = events[-1]["response"]
    assert without_times(final) == without_times(CODEC.encode_response(conv, FULL_ANSWER))

    def joined(event_type: str, item_id: str) -> str:
        return "".join(e["delta"] for e in events if e["type"] == event_type and e["item_id"] == item_id)

    reasoning, message, patch, shell = final["output"]
    assert joined("response.reasoning_summary_text.delta", reasoning["id"]) == FULL_ANSWER.reasoning
    assert joined("response.output_text.delta", message["id"]) == FULL_ANSWER.content
    assert joined("response.custom_tool_call_input.delta", patch["id"]) == PATCH
    shell_arguments = joined("response.function_call_arguments.delta", shell["id"])
    assert shell_arguments == FULL_ANSWER.tool_calls[1].arguments
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and all(e["logprobs"] == [] and e["content_index"] == 0 for e in deltas)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]


def test_stream_of_a_cut_answer_ends_incomplete():
    events = stream_events(conversation(stream=True), make_completion("cut sho", finish_reason="length"))
    name, payload = events[-1]
    assert name == "response.incomplete" and payload["response"]["status"] == "incomplete"
    EVENT.validate_python(payload)


# ---- errors and models -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [
        ("invalid_request", 400, None),
        ("context_length", 400, "context_length_exceeded"),
        ("not_found", 404, "unknown_url"),
        ("overloaded", 503, "engine_unavailable"),
        ("engine_error", 502, "engine_error"),
    ],
)
def test_errors_have_openai_shape_and_status(kind, status, code):
    answer = CODEC.encode_error(GatewayError(kind, "nope"))
    error = json.loads(answer.body)["error"]
    assert answer.status == status
    assert (error["message"], error["param"], error["code"]) == ("nope", None, code)


def test_models_listing_is_served_locally():
    assert CODEC.models_path("/v1/models", "GET") and not CODEC.models_path("/v1/responses", "GET")
    listing = CODEC.encode_models(["gpt-5-codex"], "/v1/models")
    assert [m["id"] for m in listing["data"]] == ["gpt-5-codex"]
    assert CODEC.encode_models(["gpt-5-codex"], "/v1/models/gpt-5-codex")["object"] == "model"


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
    client = sdk_client(FULL_ANSWER, seen)
    request = {
        key: CODEX_REQUEST[key]
        for key in (
            "model",
            "instructions",
            "input",
            "tools",
            "reasoning",
            "store",
            "include",
            "parallel_tool_calls",
        )
    }
    plain = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        typed_events = list(stream)
        streamed = stream.get_final_response()
    assert seen[0].messages == seen[1].messages == decode(CODEX_REQUEST).messages
    assert typed_events[0].type == "response.created" and typed_events[-1].type == "response.completed"
    for response in (plain, streamed):
        assert response.output_text == FULL_ANSWER.content
        assert [item.type for item in response.output] == [
            "reasoning",
            "message",
            "custom_tool_call",
            "function_call",
        ]
        assert response.output[2].input == PATCH
        assert response.output[3].arguments == FULL_ANSWER.tool_calls[1].arguments


def test_sdk_client_sees_a_bad_request_error_for_previous_response_id():
    client = sdk_client(FULL_ANSWER, [])
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(model="m", input="hi", previous_response_id="resp_earlier")
    assert caught.value.status_code == 400 and "send the full input" in caught.value.message


# ---- robustness --------------------------------------------------------------------------------------------

_KEYS = st.sampled_from(
    [
        "model",
        "input",
        "instructions",
        "type",
        "role",
        "content",
        "text",
        "call_id",
        "name",
        "arguments",
        "output",
        "summary",
        "encrypted_content",
        "tools",
        "parameters",
        "format",
        "tool_choice",
        "reasoning",
        "effort",
        "include",
        "store",
        "stream",
        "max_output_tokens",
        "message",
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "input_text",
        "output_text",
        "input_image",
        "user",
        "assistant",
        "developer",
        "previous_response_id",
    ]
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=5) | _KEYS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(_KEYS | st.text(max_size=3), children, max_size=5)
    ),
    max_leaves=30,
)
_TEXT = st.text(max_size=8)
_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal"]), "text": _TEXT | _JSON}
)
# Mostly plausible items, sometimes anything: deep code paths get reached, not only the first type check.
_ITEM = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "developer", "x"])},
        optional={"type": st.just("message"), "content": _TEXT | st.lists(_PART, max_size=2) | _JSON},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "custom_tool_call"]), "call_id": _TEXT, "name": _TEXT},
        optional={"arguments": _TEXT | _JSON, "input": _TEXT | _JSON},
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function_call_output", "custom_tool_call_output"]),
            "call_id": _TEXT,
            "output": _TEXT | st.lists(_PART, max_size=2) | _JSON,
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("reasoning")},
        optional={
            "summary": st.lists(
                st.fixed_dictionaries({"type": st.just("summary_text"), "text": _TEXT}), max_size=2
            )
            | _JSON,
            "encrypted_content": _TEXT | _JSON,
            "content": _JSON,
        },
    ),
    _JSON,
)
_TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "custom", "web_search"]), "name": _TEXT},
    optional={"parameters": _JSON, "format": _JSON, "description": _TEXT | _JSON},
)
_BODY = _JSON | st.fixed_dictionaries(
    {"input": st.lists(_ITEM, min_size=1, max_size=5) | _TEXT | _JSON},
    optional={
        "model": _TEXT | _JSON,
        "instructions": _TEXT | _JSON,
        "tools": st.lists(_TOOL, max_size=2) | _JSON,
        "tool_choice": _JSON,
        "reasoning": _JSON,
        "include": st.just(["reasoning.encrypted_content"]) | _JSON,
        "store": _JSON,
        "stream": _JSON,
        "max_output_tokens": _JSON,
        "previous_response_id": _JSON,
        "metadata": _JSON,
        "text": _JSON,
        "parallel_tool_calls": _JSON,
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_BODY)
def test_arbitrary_json_bodies_raise_only_gateway_errors(body):
    try:
        conv = CODEC.decode_request(body, "/v1/responses", {})
    except GatewayError as error:
        assert error.kind == "invalid_request" and error.message
        return
    # Whatever decodes must also encode into events the SDK accepts.
    for _, payload in stream_events(conv, FULL_ANSWER):
        EVENT.validate_python(payload)
