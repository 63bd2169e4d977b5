"""The embedded engine against the official openai SDK and raw HTTP: SGLang's contract, true logprobs."""

from __future__ import annotations

import json
import time

import pytest
from openai import BadRequestError, OpenAI

from polar_mitm.engines import keys as engine_keys
from tests.engines import keyed

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Write hello into out.txt"},
]


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=engine_keys.key_for(url) or "unused", max_retries=0)


def ids_extra(choice) -> tuple[list[int], list[int]]:
    extra = choice.model_extra or {}
    return extra["prompt_token_ids"], extra["response_token_ids"]


def test_chat_answer_parses_and_ids_match_logprobs_and_text(engine_url, tiny_engine):
    completion = client(engine_url).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=24,
        temperature=1.0,
        seed=7,
        logprobs=True,
        extra_body={"return_token_ids": True, "return_meta_info": True},
    )
    choice = completion.choices[0]
    prompt_ids, response_ids = ids_extra(choice)
    assert len(response_ids) == len(choice.logprobs.content) == completion.usage.completion_tokens > 0
    assert all(entry.logprob <= 0 for entry in choice.logprobs.content)
    assert prompt_ids == tiny_engine.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    decoded = tiny_engine.tokenizer.decode(response_ids, skip_special_tokens=True)
    reasoning = (choice.message.model_extra or {}).get("reasoning_content")
    if reasoning is None:  # random weights: a `</think>` among the sampled ids is possible but rare
        assert decoded == choice.message.content
    else:
        assert "</think>" in decoded and decoded.endswith(choice.message.content or "")
    meta = choice.model_extra["meta_info"]
    assert meta["completion_tokens"] == len(response_ids)
    assert meta["weight_version"] is not None
    assert [t[1] for t in meta["output_token_logprobs"]] == response_ids


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_equal_a_forward_pass_of_the_same_weights(engine_url, tiny_engine, temperature):
    completion = client(engine_url).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=32,
        temperature=temperature,
        seed=3,
        logprobs=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = completion.choices[0]
    prompt_ids, response_ids = ids_extra(choice)
    served = [e.logprob for e in choice.logprobs.content]
    scored = tiny_engine.score(prompt_ids, response_ids, temperature=temperature)
    assert len(served) == len(scored) == 32
    assert max(abs(a - b) for a, b in zip(served, scored, strict=True)) <= 1e-4


def test_same_seed_same_ids_and_other_seed_other_ids(engine_url):
    def sample(seed):
        c = client(engine_url).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=16, seed=seed, extra_body={"return_token_ids": True}
        )
        return ids_extra(c.choices[0])[1]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_generate_with_input_ids_agrees_with_chat(engine_url):
    chat = client(engine_url).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=12,
        seed=5,
        temperature=0.8,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    prompt_ids, response_ids = ids_extra(chat.choices[0])
    gen = keyed.post(
        f"{engine_url}/generate",
        json={
            "input_ids": prompt_ids,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 0.8,
                "sampling_seed": 5,
                "ignore_eos": True,
            },
        },
        timeout=60,
    ).json()
    assert gen["output_ids"] == response_ids
    triples = gen["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == response_ids and all(t[0] <= 0 for t in triples)
    assert gen["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_streaming_chat_matches_non_streaming_and_sends_sglext_ids(engine_url):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=20, seed=9, temperature=1.0, logprobs=True)
    plain = client(engine_url).chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    stream = client(engine_url).chat.completions.create(
        **kwargs,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True},
    )
    text, n_logprobs, sglext, usage, finish = "", 0, None, None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        if (chunk.model_extra or {}).get("sglext"):
            sglext = chunk.model_extra["sglext"]
        for choice in chunk.choices:
            text += choice.delta.content or ""
            text += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            n_logprobs += len(choice.logprobs.content) if choice.logprobs and choice.logprobs.content else 0
            finish = choice.finish_reason or finish
    prompt_ids, response_ids = ids_extra(plain.choices[0])
    message = plain.choices[0].message
    assert text == ((message.model_extra or {}).get("reasoning_content") or "") + (message.content or "")
    assert sglext["output_ids"] == [response_ids] and sglext["input_ids"] == [prompt_ids]
    assert n_logprobs == len(response_ids) == usage.completion_tokens
    assert finish == plain.choices[0].finish_reason


def test_scripted_tool_call_parses_in_sdk_plain_and_streaming(scripted_engine_url, tiny_engine):
    c = client(scripted_engine_url)
    first = c.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, logprobs=True, extra_body={"return_token_ids": True}
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "shell" and json.loads(call.function.arguments) == {
        "command": "echo hello > out.txt"
    }
    assert choice.message.content == "Let me write the file."
    prompt_ids, response_ids = ids_extra(choice)
    # Scripted tokens still carry the model's true logprobs.
    scored = tiny_engine.score(prompt_ids, response_ids)
    served = [e.logprob for e in choice.logprobs.content]
    assert max(abs(a - b) for a, b in zip(served, scored, strict=True)) <= 1e-4
    follow_up = [
        *MESSAGES,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": ""},
    ]
    second = c.chat.completions.create(model="tiny", messages=follow_up, tools=TOOLS)
    assert second.choices[0].message.content == "Done: out.txt now says hello."
    assert second.choices[0].finish_reason == "stop"
    streamed_calls, content = {}, ""
    for chunk in c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = streamed_calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
    assert content.strip() == "Let me write the file."
    assert streamed_calls[0]["name"] == "shell"
    assert json.loads(streamed_calls[0]["arguments"]) == {"command": "echo hello > out.txt"}


def test_stop_string_is_trimmed_from_text_but_its_tokens_are_kept(scripted_engine_url, tiny_engine):
    c = client(scripted_engine_url)
    follow_up = [*MESSAGES, {"role": "assistant", "content": "x"}, {"role": "user", "content": "go on"}]
    out = c.chat.completions.create(
        model="tiny", messages=follow_up, stop=["now says"], extra_body={"return_token_ids": True}
    )
    choice = out.choices[0]
    assert choice.message.content == "Done: out.txt "
    assert choice.finish_reason == "stop"
    assert "now says" in tiny_engine.tokenizer.decode(ids_extra(choice)[1])


def test_bad_input_gets_400_and_the_server_stays_up(engine_url):
    c = client(engine_url)
    with pytest.raises(BadRequestError):
        c.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(BadRequestError):
        c.chat.completions.create(
            model="tiny",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                }
            ],
        )
    r = keyed.post(f"{engine_url}/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["object"] == "error"
    r = keyed.post(
        f"{engine_url}/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "bogus": 1}},
    )
    assert r.status_code == 400 and "bogus" in r.json()["message"]
    info = keyed.get(f"{engine_url}/model_info").json()
    too_long = [100] * (info["context_length"] + 1)
    r = keyed.post(f"{engine_url}/generate", json={"input_ids": too_long}, timeout=60)
    assert r.status_code == 400 and "context length" in r.json()["message"]
    assert keyed.get(f"{engine_url}/health").status_code == 200


def test_client_disconnect_stops_generation(engine_url):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200000, "ignore_eos": True, "stream": True}
    with keyed.stream("POST", f"{engine_url}/v1/chat/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    # The lock is released promptly: a new request completes quickly instead of waiting for 200k tokens.
    started = time.monotonic()
    out = client(engine_url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert time.monotonic() - started < 30


def test_update_weights_from_disk_changes_outputs_and_version(tmp_path, engine_url):
    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.engine.tiny_model import build_tiny_model

    def greedy():
        c = client(engine_url).chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return ids_extra(c.choices[0])[1]

    before, version = greedy(), keyed.get(f"{engine_url}/model_info").json()["weight_version"]
    other = build_tiny_model(tmp_path / "tiny-seed1", seed=1)
    r = keyed.post(f"{engine_url}/update_weights_from_disk", json={"model_path": str(other)}, timeout=60)
    assert r.status_code == 200 and r.json()["success"]
    try:
        assert keyed.get(f"{engine_url}/model_info").json()["weight_version"] != version
        assert greedy() != before
    finally:
        keyed.post(
            f"{engine_url}/update_weights_from_disk",
            json={"model_path": str(resolve_model("tiny"))},
            timeout=60,
        )
    bad = keyed.post(f"{engine_url}/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
    assert bad.status_code == 400 and not bad.json()["success"]


def test_tokenize_and_model_listing(engine_url, tiny_engine):
    r = keyed.post(f"{engine_url}/tokenize", json={"prompt": "hello world"}).json()
    assert r["tokens"] == tiny_engine.tokenizer.encode("hello world") and r["count"] == 2
    r = keyed.post(f"{engine_url}/tokenize", json={"messages": MESSAGES}).json()
    assert r["count"] == len(
        tiny_engine.tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    models = client(engine_url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
