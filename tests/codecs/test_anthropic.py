"""AnthropicCodec: requests decode into the right Conversation, answers validate against the official SDK."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as SdkMessage
from anthropic.types import ModelInfo, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from polar_mitm.codecs.anthropic import AnthropicCodec
from polar_mitm.codecs.base import GatewayError
from polar_mitm.conversation import Completion, Conversation, Message, Tool, ToolCall

CODEC = AnthropicCodec()
STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)

BILLING = "x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli; cch=8f3a1;"
READ_SCHEMA = {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}
BASH_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


def claude_code_request(billing: str = BILLING) -> dict[str, Any]:
    """A multi-turn request shaped like Claude Code's: billing block, cached system, thinking, tools."""
    return {
        "model": "claude-sonnet-4-5-20250929",
        "max_tokens": 32000,
        "stream": True,
        "temperature": 1,
        "metadata": {"user_id": "user_abc_account__session_123"},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "system": [
            {"type": "text", "text": billing},
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": "Use the tools available to you."},
        ],
        "tools": [
            {"name": "Read", "description": "Reads a file.", "input_schema": READ_SCHEMA},
            {
                "name": "Bash",
                "description": "Runs a command.",
                "input_schema": BASH_SCHEMA,
                "defer_loading": True,
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "tool_choice": {"type": "auto"},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
                    {"type": "text", "text": "What is in README.md?", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should read the file.", "signature": "c2ln"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "Read",
                        "input": {"file_path": "/r/README.md"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01", "content": "# Demo\nHello ✓"},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_02", "name": "Bash", "input": {"command": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_02",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "ls: denied"},
                            {"type": "text", "text": "exit 2"},
                        ],
                    },
                    {"type": "text", "text": "Never mind, summarise."},
                ],
            },
        ],
    }


def completion(**overrides: Any) -> Completion:
    """An engine answer built by hand; id lists and logprobs of matching lengths."""
    fields: dict[str, Any] = {
        "id": "chatcmpl-7f3a9c",
        "model": "default",
        "content": "",
        "reasoning": None,
        "tool_calls": [],
        "finish_reason": "stop",
        "prompt_ids": list(range(40)),
        "completion_ids": list(range(12)),
        "completion_logprobs": [-0.5] * 12,
    }
    fields.update(overrides)
    return Completion(**fields)


TEXT = completion(content="The README describes a demo project. It says hello, with a check mark ✓.")
FULL = completion(
    reasoning="The user wants a summary; the file is short, so one sentence will do.\nThen run ls again.",
    content="Here is the summary you asked for.",
    tool_calls=[
        ToolCall(id="call_9", name="Bash", arguments='{"command": "ls -la /r", "timeout": 30}'),
        ToolCall(id="toolu_kept", name="Read", arguments='{"file_path": "/r/ünïcode.md"}'),
    ],
    finish_reason="tool_calls",
)
EMPTY = completion(completion_ids=[], completion_logprobs=[], finish_reason="length")
THINKING_ONLY = completion(reasoning="Hmm, out of budget", finish_reason="length")
STOP_SEQUENCE = completion(content="1, 2, 3", meta_info={"finish_reason": {"type": "stop", "matched": "4"}})
ANSWERS = {
    "text": TEXT,
    "full": FULL,
    "empty": EMPTY,
    "thinking_only": THINKING_ONLY,
    "stop_sequence": STOP_SEQUENCE,
}


def sse_events(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs of an SSE byte stream, parsed the way the SDK reads the wire."""
    decoder = anthropic._streaming.SSEDecoder()  # the SDK's own parser, so we test what a client sees
    return [(sse.event, sse.json()) for sse in decoder.iter_bytes(iter(chunks))]


def assemble(events: list[dict[str, Any]]) -> SdkMessage:
    """Fold validated stream events into the final message with the SDK's own accumulator."""
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for data in events:
        snapshot = accumulate_event(
            event=STREAM_EVENT.validate_python(data), current_snapshot=snapshot, json_bufs=json_bufs
        )
    assert snapshot is not None
    return SdkMessage.model_validate(snapshot.model_dump())


# -- routing ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v1/messages", "/s/SESSION/v1/messages", "/anthropic/v1/messages", "/v1/messages/"]
)
def test_matches_messages_path_under_any_prefix(path: str) -> None:
    assert CODEC.matches(path)
    assert not CODEC.count_tokens_path(path)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/messages/count_tokens",
        "/v1/chat/completions",
        "/v1/messagesx",
        "/v1/models",
        "/v1/messages/batches",
    ],
)
def test_does_not_match_other_paths(path: str) -> None:
    assert not CODEC.matches(path)


@pytest.mark.parametrize("path", ["/v1/messages/count_tokens", "/s/S1/v1/messages/count_tokens"])
def test_count_tokens_path(path: str) -> None:
    assert CODEC.count_tokens_path(path)


@pytest.mark.parametrize(
    ("path", "method", "expected"),
    [
        ("/v1/models", "GET", True),
        ("/s/S1/v1/models", "GET", True),
        ("/v1/models/claude-x", "GET", True),
        ("/v1/models", "POST", False),
        ("/v1/models/a/b", "GET", False),
        ("/v1/modelsx", "GET", False),
    ],
)
def test_models_path(path: str, method: str, expected: bool) -> None:
    assert CODEC.models_path(path, method) is expected


# -- decoding ---------------------------------------------------------------------------------------------------------


def test_decodes_claude_code_multi_turn_request() -> None:
    conv = CODEC.decode_request(claude_code_request(), "/v1/messages", {})

    assert conv.messages == [
        Message(
            role="system",
            content="You are Claude Code, Anthropic's official CLI for Claude.\n"
            "Use the tools available to you.",
        ),
        Message(role="user", content="<system-reminder>Be brief.</system-reminder>\nWhat is in README.md?"),
        Message(
            role="assistant",
            content="Let me look.",
            reasoning="I should read the file.",
            tool_calls=[ToolCall(id="toolu_01", name="Read", arguments='{"file_path": "/r/README.md"}')],
        ),
        Message(role="tool", content="# Demo\nHello ✓", tool_call_id="toolu_01", name="Read"),
        Message(
            role="assistant", tool_calls=[ToolCall(id="toolu_02", name="Bash", arguments='{"command": "ls"}')]
        ),
        Message(role="tool", content="ls: denied\nexit 2", tool_call_id="toolu_02", name="Bash"),
        Message(role="user", content="Never mind, summarise."),
    ]
    assert conv.tools == [
        Tool(name="Read", description="Reads a file.", parameters=READ_SCHEMA),
        Tool(name="Bash", description="Runs a command.", parameters=BASH_SCHEMA),
    ]
    assert conv.model == "claude-sonnet-4-5-20250929"
    assert (conv.max_tokens, conv.temperature, conv.top_p, conv.top_k) == (32000, 1.0, None, None)
    assert conv.tool_choice == "auto"
    assert conv.stream is True
    assert conv.thinking is True
    assert conv.stop == []
    assert conv.extra == {"metadata": {"user_id": "user_abc_account__session_123"}}


def test_billing_line_removed_so_system_prefix_is_stable_across_turns() -> None:
    first = CODEC.decode_request(claude_code_request(BILLING), "/v1/messages", {})
    second = CODEC.decode_request(
        claude_code_request(BILLING.replace("cch=8f3a1", "cch=0c1d2")), "/v1/messages", {}
    )
    assert first.messages[0] == second.messages[0]
    assert "billing" not in first.messages[0].content


def test_billing_line_removed_from_system_string_keeping_the_rest() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "system": f"{BILLING}\nYou are helpful.\nBe concise.",
    }
    conv = CODEC.decode_request(body, "/v1/messages", {})
    assert conv.messages[0] == Message(role="system", content="You are helpful.\nBe concise.")


def test_mid_conversation_system_message_is_kept_as_a_system_turn() -> None:
    """Claude Code 2.1 puts its environment block in a `role: "system"` message after the first user turn."""
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": [{"type": "text", "text": BILLING}, {"type": "text", "text": "Be useful."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "# Environment\ncwd: /w", "cache_control": {"type": "ephemeral"}}
                ],
                "output_config": {"effort": "medium"},
            },
        ],
    }
    conv = CODEC.decode_request(body, "/v1/messages", {})
    assert conv.messages == [
        Message(role="system", content="Be useful."),
        Message(role="user", content="hi"),
        Message(role="system", content="# Environment\ncwd: /w"),
    ]


def test_system_absent_or_only_billing_gives_no_system_message() -> None:
    base = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    for system in (None, BILLING, [{"type": "text", "text": BILLING}]):
        body = base if system is None else {**base, "system": system}
        assert [m.role for m in CODEC.decode_request(body, "/v1/messages", {}).messages] == ["user"]


def test_user_message_mixing_text_and_tool_results_puts_results_first_in_order() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_a", "name": "A", "input": {}},
                    {"type": "tool_use", "id": "toolu_b", "name": "B", "input": {"x": [1, "é"]}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first"},
                    {"type": "tool_result", "tool_use_id": "toolu_a", "content": "ra"},
                    {"type": "text", "text": "second"},
                    {"type": "tool_result", "tool_use_id": "toolu_b"},
                ],
            },
        ],
    }
    conv = CODEC.decode_request(body, "/v1/messages", {})
    assert conv.messages[0].tool_calls[1].arguments == '{"x": [1, "é"]}'
    assert conv.messages[1:] == [
        Message(role="tool", content="ra", tool_call_id="toolu_a", name="A"),
        Message(role="tool", content="", tool_call_id="toolu_b", name="B"),
        Message(role="user", content="first\nsecond"),
    ]


def test_string_contents_and_sampling_fields() -> None:
    body = {
        "model": "m",
        "max_tokens": 64,
        "top_p": 0.9,
        "top_k": 20,
        "temperature": 0.2,
        "stop_sequences": ["END", "\n\nHuman:"],
        "stream": False,
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ],
    }
    conv = CODEC.decode_request(body, "/v1/messages", {})
    assert conv.messages == [
        Message(role="user", content="Hi"),
        Message(role="assistant", content="Hello"),
        Message(role="user", content="Bye"),
    ]
    assert (conv.top_p, conv.top_k, conv.temperature, conv.stop) == (0.9, 20, 0.2, ["END", "\n\nHuman:"])
    assert conv.thinking is None
    assert conv.stream is False


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "Bash"}, {"name": "Bash"}),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto"),
        (None, None),
    ],
)
def test_tool_choice_mapping(choice: dict[str, Any] | None, expected: Any) -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "tool_choice": choice,
    }
    assert CODEC.decode_request(body, "/v1/messages", {}).tool_choice == expected


@pytest.mark.parametrize(
    ("thinking", "expected"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, True),
        ({"type": "adaptive"}, True),
        ({"type": "disabled"}, False),
        (None, None),
    ],
)
def test_thinking_config(thinking: dict[str, Any] | None, expected: bool | None) -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "thinking": thinking,
    }
    assert CODEC.decode_request(body, "/v1/messages", {}).thinking is expected


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
PDF = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}


@pytest.mark.parametrize(
    "content",
    [
        [IMAGE, {"type": "text", "text": "what is this?"}],
        [PDF],
        [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "shot:"}, IMAGE],
            }
        ],
    ],
)
def test_images_and_documents_are_rejected(content: list[dict[str, Any]]) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": content}]}
    with pytest.raises(GatewayError) as caught:
        CODEC.decode_request(body, "/v1/messages", {})
    assert caught.value.kind == "invalid_request"
    assert "not supported" in caught.value.message


def _valid() -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}


def _with(**changes: Any) -> dict[str, Any]:
    return {**_valid(), **changes}


def _message(content: Any, role: str = "user") -> dict[str, Any]:
    return _with(messages=[{"role": role, "content": content}])


MALFORMED: dict[str, Any] = {
    "body is a list": [_valid()],
    "body is a string": "{}",
    "body is null": None,
    "messages missing": {"model": "m", "max_tokens": 5},
    "messages not a list": _with(messages={"role": "user", "content": "x"}),
    "messages empty": _with(messages=[]),
    "message not an object": _with(messages=["hello"]),
    "role unknown": _with(messages=[{"role": "tool", "content": "x"}]),
    "system message with an image": _with(messages=[{"role": "system", "content": [{"type": "image"}]}]),
    "role missing": _with(messages=[{"content": "x"}]),
    "content missing": _with(messages=[{"role": "user"}]),
    "content a number": _message(42),
    "content an object": _message({"type": "text", "text": "x"}),
    "block not an object": _message(["x"]),
    "block without type": _message([{"text": "x"}]),
    "text block without text": _message([{"type": "text"}]),
    "text not a string": _message([{"type": "text", "text": 1}]),
    "unknown block type": _message([{"type": "hologram"}]),
    "tool_use without name": _message([{"type": "tool_use", "id": "t", "input": {}}], "assistant"),
    "tool_use without id": _message([{"type": "tool_use", "name": "n", "input": {}}], "assistant"),
    "tool_use input a list": _message(
        [{"type": "tool_use", "id": "t", "name": "n", "input": [1]}], "assistant"
    ),
    "thinking not a string": _message([{"type": "thinking", "thinking": None}], "assistant"),
    "tool_result without id": _message([{"type": "tool_result", "content": "x"}]),
    "tool_result content a number": _message([{"type": "tool_result", "tool_use_id": "t", "content": 3}]),
    "tool_result nested non-text": _message(
        [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_use"}]}]
    ),
    "max_tokens missing": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
    "max_tokens a string": _with(max_tokens="5"),
    "max_tokens a float": _with(max_tokens=5.0),
    "max_tokens a bool": _with(max_tokens=True),
    "max_tokens zero": _with(max_tokens=0),
    "model a number": _with(model=3),
    "system a number": _with(system=1),
    "system block not text": _with(system=[{"type": "image"}]),
    "tools not a list": _with(tools={"name": "x"}),
    "tool not an object": _with(tools=["Bash"]),
    "tool without name": _with(tools=[{"input_schema": {"type": "object"}}]),
    "tool schema a string": _with(tools=[{"name": "x", "input_schema": "object"}]),
    "tool description a list": _with(tools=[{"name": "x", "description": [], "input_schema": {}}]),
    "tool_choice a string": _with(tool_choice="auto"),
    "tool_choice unknown type": _with(tool_choice={"type": "sometimes"}),
    "tool_choice tool without name": _with(tool_choice={"type": "tool"}),
    "temperature a string": _with(temperature="hot"),
    "temperature huge": _with(temperature=10**400),
    "top_k negative": _with(top_k=-1),
    "top_p a bool": _with(top_p=False),
    "stop_sequences a string": _with(stop_sequences="END"),
    "stop_sequences with a number": _with(stop_sequences=["END", 4]),
    "stream a string": _with(stream="yes"),
    "thinking a bool": _with(thinking=True),
    "thinking unknown type": _with(thinking={"type": "maybe"}),
    "metadata a list": _with(metadata=[]),
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_body_is_an_invalid_request(body: Any) -> None:
    with pytest.raises(GatewayError) as caught:
        CODEC.decode_request(body, "/v1/messages", {})
    assert caught.value.kind == "invalid_request"
    assert caught.value.message


def test_count_tokens_does_not_need_max_tokens() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "count me"}], "system": "sys"}
    conv = CODEC.decode_count_tokens(body, "/v1/messages/count_tokens", {})
    assert conv.messages == [Message(role="system", content="sys"), Message(role="user", content="count me")]
    assert conv.max_tokens is None
    assert CODEC.encode_count_tokens(17) == {"input_tokens": 17}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _decode_or_invalid(decode: Callable[[Any], Conversation], body: Any) -> None:
    try:
        assert isinstance(decode(body), Conversation)
    except GatewayError as error:
        assert error.kind == "invalid_request"


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_arbitrary_json_body_only_ever_raises_gateway_error(body: Any) -> None:
    _decode_or_invalid(lambda b: CODEC.decode_request(b, "/v1/messages", {}), body)
    _decode_or_invalid(lambda b: CODEC.decode_count_tokens(b, "/v1/messages/count_tokens", {}), body)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indexes) to a value nested in `value`."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    return [path for key, child in items for path in [(*prefix, key), *_paths(child, (*prefix, key))]]


REQUEST_PATHS = _paths(claude_code_request())
DELETE = object()


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(REQUEST_PATHS), st.just(DELETE) | JSON)
def test_realistic_body_with_any_part_deleted_or_garbled_only_ever_raises_gateway_error(
    path: tuple[Any, ...], garbage: Any
) -> None:
    body = copy.deepcopy(claude_code_request())  # it shares the module's schema dicts
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    if garbage is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = garbage
    _decode_or_invalid(lambda b: CODEC.decode_request(b, "/v1/messages", {}), body)


# -- encoding ---------------------------------------------------------------------------------------------------------


def _conv(stop: list[str] | None = None) -> Conversation:
    return Conversation(
        messages=[Message(role="user", content="hi")], model="claude-sonnet-4-5", stop=stop or []
    )


@pytest.mark.parametrize("name", ANSWERS)
def test_response_validates_as_sdk_message(name: str) -> None:
    answer = ANSWERS[name]
    message = SdkMessage.model_validate(CODEC.encode_response(_conv(["4"]), answer))
    assert message.id.startswith("msg_")
    assert message.model == "claude-sonnet-4-5"
    assert message.usage.input_tokens == answer.prompt_tokens
    assert message.usage.output_tokens == answer.completion_tokens
    assert (message.usage.cache_creation_input_tokens, message.usage.cache_read_input_tokens) == (0, 0)


def test_response_carries_thinking_text_and_tool_use_blocks() -> None:
    body = CODEC.encode_response(_conv(), FULL)
    message = SdkMessage.model_validate(body)
    thinking, text, bash, read = message.content
    assert thinking.type == "thinking" and thinking.thinking == FULL.reasoning and thinking.signature
    assert text.type == "text" and text.text == "Here is the summary you asked for."
    assert bash.type == "tool_use" and bash.id.startswith("toolu_") and bash.name == "Bash"
    assert bash.input == {"command": "ls -la /r", "timeout": 30}
    assert (
        read.type == "tool_use" and read.id == "toolu_kept" and read.input == {"file_path": "/r/ünïcode.md"}
    )
    assert message.stop_reason == "tool_use"
    assert body["id"] == "msg_7f3a9c"


@pytest.mark.parametrize(
    ("answer", "stop", "reason", "sequence"),
    [
        (TEXT, [], "end_turn", None),
        (STOP_SEQUENCE, ["4"], "stop_sequence", "4"),
        (STOP_SEQUENCE, ["5"], "end_turn", None),  # matched something the harness did not ask for
        (
            completion(content="x", meta_info={"finish_reason": {"type": "stop", "matched": 151645}}),
            [],
            "end_turn",
            None,
        ),
        (EMPTY, [], "max_tokens", None),
        (FULL, [], "tool_use", None),
        (completion(content="cut", finish_reason="abort"), [], "end_turn", None),
    ],
)
def test_stop_reason(answer: Completion, stop: list[str], reason: str, sequence: str | None) -> None:
    body = CODEC.encode_response(_conv(stop), answer)
    assert (body["stop_reason"], body["stop_sequence"]) == (reason, sequence)


def test_empty_answer_is_one_empty_text_block() -> None:
    assert CODEC.encode_response(_conv(), EMPTY)["content"] == [{"type": "text", "text": ""}]


def test_thinking_only_answer_has_no_text_block() -> None:
    assert [b["type"] for b in CODEC.encode_response(_conv(), THINKING_ONLY)["content"]] == ["thinking"]


def test_tool_arguments_that_are_not_an_object_are_kept_raw() -> None:
    answer = completion(
        tool_calls=[
            ToolCall(id="c1", name="Bash", arguments='{"command": "ls"'),
            ToolCall(id="c2", name="Bash", arguments="[1, 2]"),
            ToolCall(id="c3", name="Bash", arguments=""),
        ],
        finish_reason="tool_calls",
    )
    message = SdkMessage.model_validate(CODEC.encode_response(_conv(), answer))
    assert [block.input for block in message.content] == [
        {"_raw": '{"command": "ls"'},
        {"_raw": "[1, 2]"},
        {},
    ]


@pytest.mark.parametrize("name", ANSWERS)
def test_stream_events_validate_and_assemble_to_the_json_answer(name: str) -> None:
    answer, conv = ANSWERS[name], _conv(["4"])
    events = sse_events(list(CODEC.encode_stream(conv, answer)))
    for event_name, data in events:
        assert event_name == data["type"]
    payloads = [data for _, data in events if data["type"] != "ping"]  # ping is not in the SDK's event union
    for data in payloads:
        STREAM_EVENT.validate_python(data)
    assert assemble(payloads) == SdkMessage.model_validate(CODEC.encode_response(conv, answer))


def test_stream_event_order_and_real_chunking() -> None:
    events = [data for _, data in sse_events(list(CODEC.encode_stream(_conv(), FULL)))]
    kinds = [e["type"] if e["type"] != "content_block_delta" else e["delta"]["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 1
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4
    assert kinds.count("signature_delta") == 1
    assert kinds.index("signature_delta") < kinds.index("content_block_stop")
    assert kinds.count("thinking_delta") > 1 and kinds.count("text_delta") > 1
    assert kinds.count("input_json_delta") > 2
    tool_start = next(e for e in events if e["type"] == "content_block_start" and e["index"] == 2)
    assert tool_start["content_block"]["input"] == {}
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == FULL.completion_tokens


def test_empty_stream_starts_with_zero_output_tokens() -> None:
    first = sse_events(list(CODEC.encode_stream(_conv(), EMPTY)))[0][1]
    assert first["message"]["usage"]["output_tokens"] == 0


def test_assistant_answer_sent_back_decodes_to_the_same_turn() -> None:
    """The next request carries our answer verbatim: thinking, text and tool calls must survive the round trip."""
    answer = CODEC.encode_response(_conv(), FULL)
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": answer["content"]}],
    }
    turn = CODEC.decode_request(body, "/v1/messages", {}).messages[1]
    assert turn.reasoning == FULL.reasoning
    assert turn.content == FULL.content
    assert [(c.name, c.arguments_obj()) for c in turn.tool_calls] == [
        (c.name, c.arguments_obj()) for c in FULL.tool_calls
    ]
    assert [c.id for c in turn.tool_calls] == [block["id"] for block in answer["content"][2:]]


# -- errors and auxiliary endpoints -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "status", "error_type"),
    [
        ("invalid_request", 400, "invalid_request_error"),
        ("context_length", 400, "invalid_request_error"),
        ("not_found", 404, "not_found_error"),
        ("overloaded", 529, "overloaded_error"),
        ("engine_error", 500, "api_error"),
    ],
)
def test_error_shape_and_status(kind: str, status: int, error_type: str) -> None:
    answer = CODEC.encode_error(GatewayError(kind, "what went wrong"))  # type: ignore[arg-type]
    assert answer.status == status and answer.content_type == "application/json"
    parsed = ErrorResponse.model_validate(json.loads(answer.body))
    assert parsed.type == "error"
    assert (parsed.error.type, parsed.error.message) == (error_type, "what went wrong")


def test_models_list_and_lookup_validate_as_sdk_model_info() -> None:
    page = CODEC.encode_models(["claude-a", "claude-b"], "/s/S1/v1/models")
    assert [ModelInfo.model_validate(m).id for m in page["data"]] == ["claude-a", "claude-b"]
    assert (page["has_more"], page["first_id"], page["last_id"]) == (False, "claude-a", "claude-b")
    one = ModelInfo.model_validate(CODEC.encode_models(["claude-a"], "/v1/models/claude-sonnet-4-5"))
    assert (one.id, one.type) == ("claude-sonnet-4-5", "model")
    assert CODEC.encode_models([], "/v1/models") == {
        "data": [],
        "has_more": False,
        "first_id": None,
        "last_id": None,
    }


# -- the official client, end to end through the codec -----------------------------------------------------------------


def sdk_client(answer: Completion, seen: list[Conversation]) -> anthropic.Anthropic:
    """An Anthropic SDK client whose HTTP transport is a tiny in-process gateway built on the codec."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if request.method == "GET" and CODEC.models_path(path, "GET"):
            return httpx2.Response(200, json=CODEC.encode_models(["claude-local"], path))
        try:
            body = json.loads(request.content)
            if CODEC.count_tokens_path(path):
                conv = CODEC.decode_count_tokens(body, path, {})
                return httpx2.Response(200, json=CODEC.encode_count_tokens(len(conv.messages_json())))
            conv = CODEC.decode_request(body, path, {})
        except GatewayError as error:
            failure = CODEC.encode_error(error)
            return httpx2.Response(
                failure.status, content=failure.body, headers={"content-type": failure.content_type}
            )
        seen.append(conv)
        if conv.stream:
            return httpx2.Response(
                200,
                content=b"".join(CODEC.encode_stream(conv, answer)),
                headers={"content-type": "text/event-stream"},
            )
        return httpx2.Response(200, json=CODEC.encode_response(conv, answer))

    http_client = httpx2.Client(transport=httpx2.MockTransport(handle))
    return anthropic.Anthropic(
        api_key="session-1", base_url="http://gateway/s/session-1", http_client=http_client, max_retries=0
    )


SDK_TOOLS: list[Any] = [{"name": "Bash", "description": "Runs a command.", "input_schema": BASH_SCHEMA}]


def test_sdk_client_create_and_stream_agree() -> None:
    seen: list[Conversation] = []
    client = sdk_client(FULL, seen)
    kwargs: dict[str, Any] = {
        "model": "claude-local",
        "max_tokens": 256,
        "tools": SDK_TOOLS,
        "system": [{"type": "text", "text": BILLING}, {"type": "text", "text": "Be useful."}],
        "messages": [{"role": "user", "content": "list files"}],
        "thinking": {"type": "enabled", "budget_tokens": 128},
    }
    created = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        texts = list(stream.text_stream)
        streamed = stream.get_final_message()

    assert SdkMessage.model_validate(streamed.model_dump()) == created
    assert "".join(texts) == FULL.content
    assert [block.type for block in created.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert seen[0].messages[0] == Message(role="system", content="Be useful.")
    assert seen[0].stream is False and seen[1].stream is True


def test_sdk_client_sees_errors_count_tokens_and_models() -> None:
    client = sdk_client(TEXT, [])
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="m",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                        }
                    ],
                }
            ],
        )
    assert "not supported" in str(caught.value)
    counted = client.messages.count_tokens(model="m", system="s", messages=[{"role": "user", "content": "x"}])
    assert counted.input_tokens == 2
    assert [m.id for m in client.models.list()] == ["claude-local"]
    assert client.models.retrieve("claude-any").id == "claude-any"
