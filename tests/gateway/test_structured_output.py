"""Structured output from all four APIs reaches the engine, which decodes under the grammar (llguidance, on CPU).

The engine here is the *unscripted* tiny model: random weights, so without the constraint it writes token soup;
with it every answer must validate against the request's schema. Schemas use enums, booleans and bounded integers —
a random model never closes a free string (nor an unbounded number), so a free-text field would only end at the token budget (a real
model does close them; the grammar is the same). The record says the call was constrained.
"""

from __future__ import annotations

import json
import uuid

import jsonschema
import pytest

from polar_mitm.agent.sdk_agent import base_url_for
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import read_all

SCHEMA = {
    "type": "object",
    "properties": {
        "next_speaker": {"type": "string", "enum": ["user", "model"]},
        "done": {"type": "boolean"},
        "steps": {
            "type": "integer",
            "minimum": 0,
            "maximum": 99,
        },  # unbounded, digits could run to the budget
    },
    "required": ["next_speaker", "done", "steps"],
    "additionalProperties": False,
}
PROMPT = "Who speaks next? Answer in JSON."


@pytest.fixture(scope="module")
def free_gateway(engine_url, tmp_path_factory):
    """The gateway in front of the unscripted tiny engine; budgets capped so a runaway answer stays short."""
    root = tmp_path_factory.mktemp("structured")
    gw = gateway_processes.start_gateway(
        engine_url,
        root / "flows",
        confdir=root / "conf",
        log=root / "gateway.log",
        options={"polar_max_tokens": "64"},
    )
    yield gw
    gw.stop()


def ask_openai_chat(base: str) -> str:
    import openai

    client = openai.OpenAI(api_key="sk-test", base_url=base, max_retries=0)
    answer = client.chat.completions.create(
        model="gpt-4.1",
        messages=[{"role": "user", "content": PROMPT}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "next", "schema": SCHEMA, "strict": True},
        },
    )
    return answer.choices[0].message.content


def ask_openai_responses(base: str) -> str:
    import openai

    client = openai.OpenAI(api_key="sk-test", base_url=base, max_retries=0)
    answer = client.responses.create(
        model="gpt-5",
        input=PROMPT,
        store=False,
        text={"format": {"type": "json_schema", "name": "next", "schema": SCHEMA, "strict": True}},
    )
    return answer.output_text


def ask_google(base: str, field: str) -> str:
    from google import genai
    from google.genai import types

    client = genai.Client(api_key="test", http_options=types.HttpOptions(base_url=base))
    schema = (
        SCHEMA
        if field == "response_json_schema"
        else {
            "type": "OBJECT",
            "properties": {
                "next_speaker": {"type": "STRING", "enum": ["user", "model"]},
                "done": {"type": "BOOLEAN"},
                "steps": {"type": "INTEGER", "minimum": 0, "maximum": 99},
            },
            "required": ["next_speaker", "done", "steps"],
        }
    )
    config = types.GenerateContentConfig(response_mime_type="application/json", **{field: schema})
    return client.models.generate_content(model="gemini-2.5-flash", contents=PROMPT, config=config).text


def ask_anthropic(base: str) -> str:
    import anthropic

    client = anthropic.Anthropic(api_key="sk-test", base_url=base, max_retries=0)
    answer = client.messages.create(
        model="claude-sonnet-4-6",
        max_tokens=64,
        messages=[{"role": "user", "content": PROMPT}],
        extra_body={"output_format": {"type": "json_schema", "schema": SCHEMA}},
    )
    return "".join(block.text for block in answer.content if block.type == "text")


CLIENTS = {
    "openai_chat": ("openai_chat", ask_openai_chat),
    "openai_responses": ("openai_responses", ask_openai_responses),
    "google-responseJsonSchema": ("google", lambda base: ask_google(base, "response_json_schema")),
    "google-responseSchema": ("google", lambda base: ask_google(base, "response_schema")),
    "anthropic": ("anthropic", ask_anthropic),
}


@pytest.mark.parametrize("client", list(CLIENTS))
def test_schema_constrained_answer_from_the_unscripted_engine_is_valid_json(free_gateway, client):
    provider, ask = CLIENTS[client]
    session = f"json-{client}-{uuid.uuid4().hex[:6]}"
    text = ask(base_url_for(provider, free_gateway.reverse_url, SessionId(session).path_prefix))
    jsonschema.validate(json.loads(text), SCHEMA)

    rows = [r for r in read_all(free_gateway.out_dir).to_pylist() if r["session_id"] == session]
    assert len(rows) == 1 and rows[0]["status_code"] == 200
    assert rows[0]["output_constraint"] == "json_schema" and rows[0]["call_kind"] == "side"
    assert rows[0]["finish_reason"] == "stop"
    # The engine reported decoding under the grammar, and its logprobs are of the masked distribution.
    assert json.loads(rows[0]["engine_meta_json"])["constraint"] == "json_schema"


def test_masked_logprobs_are_at_least_the_models_own(tiny_engine):
    """SGLang's vocab mask comes before the softmax: a constrained token's logprob is renormalised upwards."""
    from polar_mitm.engine.sampling import SamplingParams

    prompt = tiny_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    params = SamplingParams.from_sglang(
        {"max_new_tokens": 48, "json_schema": json.dumps(SCHEMA), "sampling_seed": 3}
    )
    gen = tiny_engine.generate(prompt, params)
    jsonschema.validate(json.loads(gen.text), SCHEMA)
    free = tiny_engine.score(prompt, gen.output_ids)
    assert all(c >= f - 1e-4 for c, f in zip(gen.output_logprobs, free, strict=True))
    assert sum(gen.output_logprobs) > sum(free) + 1.0  # the mask moved real probability mass


def test_a_schema_that_does_not_compile_is_a_client_error(free_gateway):
    import openai

    client = openai.OpenAI(api_key="sk-test", base_url=f"{free_gateway.reverse_url}/v1", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}},
            },
        )


def test_constrained_calls_are_left_out_of_the_loss_and_counted(free_gateway, tiny_engine):
    """A grammar-masked call's logprobs are not the policy's: merge marks the turn, training leaves it out."""
    import openai
    import pyarrow as pa

    from polar_mitm.reconstruct.merge import merge_table
    from polar_mitm.reconstruct.turns import sequences_from_table
    from polar_mitm.storage.records import RECORD_SCHEMA
    from polar_mitm.train.data import build_training_data

    sessions = {f"grammar-{k}-{uuid.uuid4().hex[:6]}": k for k in ("constrained", "free")}
    for session, kind in sessions.items():
        base_url = SessionId(session, "json-task").base_url(free_gateway.reverse_url, "/v1")
        client = openai.OpenAI(api_key="sk-test", base_url=base_url, max_retries=0)
        extra = (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "next", "schema": SCHEMA}}}
            if kind == "constrained"
            else {"max_tokens": 8}
        )
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}], **extra)
    rows = [r for r in read_all(free_gateway.out_dir).to_pylist() if r["session_id"] in sessions]
    table, _ = merge_table(
        pa.Table.from_pylist(rows, schema=RECORD_SCHEMA),
        eot_token_id=tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    merged = sequences_from_table(table)
    by_kind = {sessions[s.session_id]: s for s in merged}
    assert list(by_kind["constrained"].turn_constrained) == [True]
    assert list(by_kind["free"].turn_constrained) == [False]
    for seq in merged:
        seq.reward = 1.0 if sessions[seq.session_id] == "free" else 0.0
    data = build_training_data(merged)
    assert data.stats.excluded_constrained_turns == 1
    assert [r["session_id"] for r in data.rows] == [s for s, k in sessions.items() if k == "free"]
    kept = build_training_data(merged, keep_truncated_sampling=True)
    assert kept.stats.excluded_constrained_turns == 0 and len(kept.rows) == 2
