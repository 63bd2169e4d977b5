"""A real vLLM (CPU build) behind the real gateway: what the records hold is what vLLM sampled and what the model
says, in both prompt modes, streamed and not; weight pushes reach a tied head; vLLM down is a provider error.

One vLLM server and one gateway for the whole session (tests/vllm/conftest.py). Each call is checked against two
independent references: vLLM itself scoring the recorded tokens (`prompt_logprobs` of prompt + sampled ids) and
transformers on the same checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import orjson
import pytest

from polar_mitm.agent.sdk_agent import DRIVERS
from polar_mitm.engines import weights
from polar_mitm.engines.client import EngineClient, sse_frames
from polar_mitm.engines.stream import StreamAssembler
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import ports
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.engine_info import read_engine_file
from polar_mitm.storage.records import read_all
from polar_mitm.vllm.server import resolve_vllm_model, vllm_paced
from tests.engines import keyed
from tests.vllm.conftest import MID_CALL_PACE

API_KEY = "sk-polar-vllm-SECRET-51c2"
LOGPROB_TOLERANCE = 1e-4  # fp32 on CPU: vLLM and transformers agree far closer than this (measured 0.0 here)


def vllm_scores(vllm_url: str, served: str, prompt_ids: list[int], sampled_ids: list[int]) -> list[float]:
    """vLLM's own log-probabilities of `sampled_ids` after `prompt_ids` (prompt logprobs are never processed)."""
    answer = keyed.post(
        f"{vllm_url}/v1/completions",
        json={"model": served, "prompt": prompt_ids + sampled_ids, "max_tokens": 1, "prompt_logprobs": 0},
        timeout=120,
    ).json()
    entries = answer["choices"][0]["prompt_logprobs"][len(prompt_ids) :]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, sampled_ids, strict=True)]


def max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def session_records(gateway, session: str) -> list[dict]:
    rows = [r for r in read_all(gateway.out_dir).to_pylist() if r["session_id"] == session]
    return sorted(rows, key=lambda r: r["seq"])


def proxied(monkeypatch, gateway, session: str, task: str) -> None:
    """HTTPS_PROXY mode: the SDKs keep talking to the real provider hosts, through the gateway."""
    monkeypatch.setenv("HTTPS_PROXY", SessionId(session, task).proxy_url(f"127.0.0.1:{gateway.proxy_port}"))
    monkeypatch.setenv("SSL_CERT_FILE", str(gateway.ca_bundle()))
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)


def check_record_is_vllms(row: dict, vllm_url: str, vllm_reference) -> float:
    """The record's ids and logprobs are vLLM's sample, scored alike by vLLM and by transformers; returns max |Δ|."""
    assert row["error"] is None and row["status_code"] == 200, row["error"]
    meta = json.loads(row["engine_meta_json"])
    assert meta["engine"] == "vllm" and meta["logprobs_temperature_scaled"] is True
    assert row["temperature"] == 1.0 and row["weight_version"] is not None
    prompt, sampled, logprobs = row["prompt_ids"], row["completion_ids"], row["completion_logprobs"]
    assert len(logprobs) == len(sampled) > 0 and row["prompt_tokens"] == len(prompt)
    by_vllm = vllm_scores(vllm_url, row["model_used"], prompt, sampled)
    by_transformers = vllm_reference(prompt, sampled)
    gap = max(max_gap(logprobs, by_vllm), max_gap(logprobs, by_transformers))
    assert gap <= LOGPROB_TOLERANCE, (gap, logprobs, by_vllm, by_transformers)
    return gap


def engine_description(gateway, *, timeout: float = 60.0) -> dict:
    """`_engine.json` once the gateway has written it with the end-of-turn token (after its renderer loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        description = read_engine_file(str(gateway.out_dir))
        if description is not None and "eot_token_id" in description:
            return description
        time.sleep(0.1)
    raise AssertionError(f"no complete _engine.json in {gateway.out_dir} after {timeout:.0f} s")


def test_the_gateway_detects_vllm_and_describes_it(vllm_gateway, vllm_model_dir):
    description = engine_description(vllm_gateway)
    assert description["engine_kind"] == "vllm" and description["engine"] == "vllm"
    assert description["logprobs_mode"] == "processed_logprobs"
    assert description["logprobs_temperature_scaled"] is True
    assert description["tokenizer_path"] == str(vllm_model_dir)
    assert description["eot_token_id"] == 151645  # tokens mode's renderer loaded vLLM's tokenizer


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("provider", list(DRIVERS))
def test_official_sdk_call_through_the_gateway_is_vllms_sample(
    vllm_gateway, vllm_url, vllm_reference, monkeypatch, provider, stream
):
    session = f"vllm-{provider}-{uuid.uuid4().hex[:8]}"
    proxied(monkeypatch, vllm_gateway, session, "vllm-sdk")
    sdk_call(provider, stream)
    (row,) = session_records(vllm_gateway, session)
    assert row["provider"] == provider and row["stream"] is stream and row["mode"] == "regular"
    assert row["prompt_mode"] == "messages" and row["splice_reason"] is not None  # a chain's first call
    assert json.loads(row["engine_meta_json"])["endpoint"] == "/v1/chat/completions"
    gap = check_record_is_vllms(row, vllm_url, vllm_reference)
    print(f"{provider} stream={stream}: max |Δ logprob| vs vLLM and transformers {gap:.2e}")
    assert API_KEY not in json.dumps(row, default=str) and API_KEY not in vllm_gateway.log.read_text()


def sdk_call(provider: str, stream: bool) -> None:
    """One call of the official SDK, which must parse the answer. A random model answers text until the token
    budget ends (the session ends after one call: a `<tool_call>` is ~1e-5 per token)."""
    if provider == "openai_responses" and stream:
        # A budget-cut Responses stream ends with `response.incomplete`, which the SDK's stream helper refuses.
        import openai

        client = openai.OpenAI(api_key=API_KEY, max_retries=0)
        events = list(
            client.responses.create(model="gpt-5-codex", input="Say hello", stream=True, store=False)
        )
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.incomplete_details.reason == "max_output_tokens"
        return
    result = DRIVERS[provider]("Say hello", api_key=API_KEY, base_url=None, stream=stream, max_turns=1)
    assert result.calls == 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_second_turn_goes_token_in_and_extends_the_first_exactly(
    vllm_gateway, vllm_url, vllm_reference, stream
):
    """Turn 2 of a session is sent as ids to vLLM's /v1/completions; its prompt starts with turn 1's prompt and
    sampled ids (up to the end of turn), and its logprobs are still vLLM's."""
    session = f"vllm-tokens-{stream}-{uuid.uuid4().hex[:8]}"
    base = f"{vllm_gateway.reverse_url}{SessionId(session, 'vllm-tokens').path_prefix}/v1"
    messages = [{"role": "user", "content": "Write one word."}]
    for turn in range(2):
        answer = chat(base, messages, stream)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Again ({turn})."},
        ]
    first, second = session_records(vllm_gateway, session)
    assert second["prompt_mode"] == "tokens" and second["spliced_turns"] == 1, second["splice_reason"]
    assert json.loads(second["engine_meta_json"])["endpoint"] == "/v1/completions"
    turn_one = first["prompt_ids"] + first["completion_ids"]  # cut short or closed, carried verbatim
    assert second["prompt_ids"][: len(turn_one)] == turn_one
    check_record_is_vllms(first, vllm_url, vllm_reference)
    check_record_is_vllms(second, vllm_url, vllm_reference)


def chat(base: str, messages: list[dict], stream: bool) -> str:
    """One OpenAI Chat call over plain HTTP; the answer's text (streamed deltas joined)."""
    body = {"model": "gpt-4.1", "messages": messages, "stream": stream}
    headers = {"authorization": f"Bearer {API_KEY}"}
    if not stream:
        response = keyed.post(f"{base}/chat/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"] or ""
    text = ""
    with keyed.stream(
        "POST", f"{base}/chat/completions", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices") or ():
                    text += choice.get("delta", {}).get("content") or ""
    return text


def test_a_stream_aborted_by_name_ends_with_the_ids_sampled_so_far(vllm_url):
    """Mid-stream abort on vLLM (what the gateway does when a harness leaves): `/abort_requests` with our request
    id, then the stream's end gives the prompt and the ids sampled up to the abort, one logprob each. vLLM is paced
    (MID_CALL_PACE): under the suite's load its whole stream once came after the sampling, and the abort too late."""
    rid = f"req_{uuid.uuid4().hex}"

    async def run() -> StreamAssembler:
        client = EngineClient(vllm_url)
        body = {
            "model": "default",
            "input_ids": [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198],
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "logprobs": True,
            "max_tokens": 4000,
            "temperature": 1.0,
            "ignore_eos": True,
            "rid": rid,
        }
        assembler, aborted = StreamAssembler(), False
        try:
            async with client.open_stream(orjson.dumps(body)) as stream:
                async for _, data in sse_frames(stream):
                    if data == b"[DONE]":
                        break
                    assembler.feed(orjson.loads(data))
                    # At least 3: a server that fell behind sends several tokens in one chunk (seen: 1, then 100).
                    if len(assembler.logprobs) >= 3 and not aborted:
                        await client.abort_request(rid)
                        aborted = True
        finally:
            await client.aclose()
        return assembler

    with vllm_paced(vllm_url, MID_CALL_PACE):
        assembler = asyncio.run(run())
    completion = assembler.completion()
    assert completion.finish_reason == "abort"
    assert 3 <= completion.completion_tokens < 4000
    assert len(completion.completion_logprobs) == completion.completion_tokens
    assert completion.prompt_ids[:3] == [151644, 872, 198]


def test_weight_push_reaches_the_tied_head(vllm_url, vllm_reference, vllm_model_dir):
    """A full-checkpoint push through the worker extension: the next answers' logprobs are transformers' with the
    new weights, tied head included — where vLLM's own reload_weights leaves the head on the old weights."""
    new_dir = resolve_vllm_model("tiny", seed=1)
    assert json.loads((new_dir / "config.json").read_text())["tie_word_embeddings"] is True
    served = keyed.get(f"{vllm_url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompt = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]
    probe = [9707, 11, 1879, 0]
    before = weights.engine_weight_version(vllm_url)
    try:
        keyed.post(
            f"{vllm_url}/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(new_dir)}},
            timeout=120,
        ).raise_for_status()
        stale = vllm_scores(vllm_url, served, prompt, probe)
        assert max_gap(stale, vllm_reference(prompt, probe, new_dir)) > 1e-2, (
            "vLLM's own reload is right now?"
        )

        version = weights.push_weights(vllm_url, new_dir)
        assert weights.engine_weight_version(vllm_url) == version != before
        pushed = vllm_scores(vllm_url, served, prompt, probe)
        gap = max_gap(pushed, vllm_reference(prompt, probe, new_dir))
        print(f"after the push: max |Δ logprob| vs transformers with the new weights {gap:.2e}")
        assert gap <= LOGPROB_TOLERANCE
        assert max_gap(pushed, vllm_reference(prompt, probe, vllm_model_dir)) > 1e-2
    finally:
        weights.push_weights(vllm_url, vllm_model_dir)  # the session's other tests score the original weights
    assert (
        max_gap(vllm_scores(vllm_url, served, prompt, probe), vllm_reference(prompt, probe))
        <= LOGPROB_TOLERANCE
    )


def test_count_tokens_and_model_listing_are_answered_from_vllm(vllm_gateway, vllm_url):
    base = f"{vllm_gateway.reverse_url}/t/vllm/s/side-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "user", "content": "Count these tokens, please."}]
    counted = keyed.post(
        f"{base}/v1/messages/count_tokens",
        json={"model": "claude-sonnet-4-6", "messages": messages},
        headers={"anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert counted.status_code == 200, counted.text
    by_vllm = keyed.post(
        f"{vllm_url}/tokenize", json={"messages": messages, "add_generation_prompt": False}, timeout=60
    ).json()["count"]
    assert counted.json()["input_tokens"] == by_vllm > 0
    served = keyed.get(f"{vllm_url}/v1/models", timeout=30).json()["data"][0]["id"]
    listed = keyed.get(f"{base}/v1/models", timeout=30).json()
    assert served in [model["id"] for model in listed["data"]]


def test_context_overflow_on_vllm_is_the_providers_400(vllm_gateway, vllm_url):
    base = f"{vllm_gateway.reverse_url}/t/vllm/s/overflow-{uuid.uuid4().hex[:6]}/v1"
    context = keyed.get(f"{vllm_url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    body = {"model": "gpt-4.1", "messages": [{"role": "user", "content": "word " * (context + 1000)}]}
    response = keyed.post(f"{base}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_vllm_down_is_a_provider_shaped_error(tmp_path):
    """polar_engine=vllm with nothing listening: OpenAI's 503 and Anthropic's 529, recorded — no vLLM needed."""
    dead = f"http://127.0.0.1:{ports.free_port()}"
    with gateway_processes.gateway_running(
        dead, tmp_path / "flows", confdir=tmp_path / "conf", options={"polar_engine": "vllm"}
    ) as gateway:
        base = f"{gateway.reverse_url}/t/down/s/vllm-down"
        openai = keyed.post(
            f"{base}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        anthropic = keyed.post(
            f"{base}/v1/messages",
            json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            headers={"anthropic-version": "2023-06-01"},
            timeout=60,
        )
    assert openai.status_code == 503 and openai.json()["error"]["message"]
    assert anthropic.status_code == 529 and anthropic.json()["error"]["type"] == "overloaded_error"
    rows = read_all(gateway.out_dir).to_pylist()
    assert len(rows) == 2 and all(r["finish_reason"] == "error" and "overloaded" in r["error"] for r in rows)


@pytest.mark.parametrize("top_p", [1.0, 0.9], ids=["full", "top_p"])
def test_recorded_logprobs_are_the_trainers_at_the_sampling_temperature(vllm_url, vllm_reference, top_p):
    """At T=0.7 vLLM's processed logprobs are log_softmax(logits / T), as the trainer scores them; with top_p < 1
    they are of the truncated distribution instead — such turns are left out of the loss (train/turn_sampling.py),
    and the record keeps the top_p that says so."""
    prompt = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]
    body = {"model": "default", "input_ids": prompt, "messages": [], "max_tokens": 16, "logprobs": True}

    async def sample() -> dict:
        client = EngineClient(vllm_url)
        try:
            raw = await client.chat(orjson.dumps({**body, "temperature": 0.7, "top_p": top_p, "top_k": -1}))
        finally:
            await client.aclose()
        return orjson.loads(raw)["choices"][0]

    choice = asyncio.run(sample())
    sampled, logprobs = choice["response_token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]
    assert choice["meta_info"]["logprobs_temperature_scaled"] is True
    gap_at_t = max_gap(logprobs, vllm_reference(prompt, sampled, temperature=0.7))
    gap_at_1 = max_gap(logprobs, vllm_reference(prompt, sampled))
    print(f"top_p={top_p}: max |Δ| vs transformers at T=0.7 {gap_at_t:.2e}, at T=1 {gap_at_1:.2e}")
    assert gap_at_1 > 1e-2  # the temperature is in them (vLLM's default raw_logprobs would be the T=1 values)
    if top_p == 1.0:
        assert gap_at_t <= LOGPROB_TOLERANCE
    else:
        assert gap_at_t > 1e-3  # renormalised over the nucleus: not what the trainer computes
