"""A call the engine aborts is resumed by the gateway (issue 43): the embedded engine started with `--on-push abort`
ends a running generation when weights are pushed (SGLang's default), the gateway sends prompt + the tokens sampled
so far back with the rest of the budget, and the harness (the openai SDK, streaming) reads one unbroken answer — no
token lost or repeated, the tool call written after the abort still a call — while the one record joins the parts
with a version span each. A call aborted a fourth time ends as an engine error."""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import openai
import pytest
import torch

from polar_mitm.agent.sdk_agent import join_chat_stream
from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines.weights import push_weights
from polar_mitm.processes import children
from polar_mitm.session_ids import SessionId
from tests.gateway.test_inflight_push import fresh_logprobs
from tests.gateway.test_streaming_live import (
    API_KEY,
    SCRIPT,
    SHELL_SCHEMA,
    SYSTEM,
    USER_TEXT,
    _gateway,
    _records,
)

COUNT = "Count slowly."
COUNTING = " ".join(f"n{i}" for i in range(60))  # a long answer: room for four aborts
TOOLS = [
    {
        "type": "function",
        "function": {"name": "shell", "description": "Run a shell command", "parameters": SHELL_SCHEMA},
    }
]


@pytest.fixture(scope="module")
def aborting(tmp_path_factory):
    """The scripted tiny engine at 0.08 s a token whose pushes abort running calls, a gateway in front of it, and
    which checkpoint each weight version it served holds."""
    root = tmp_path_factory.mktemp("abort-engine")
    script = root / "script.json"
    script.write_text(json.dumps({"turns": SCRIPT, "replies": [{"when": COUNT, "text": COUNTING}]}))
    proc, url = engine_processes.start_engine(
        "tiny",
        log=root / "engine.log",
        extra_args=["--script", str(script), "--token-delay", "0.08", "--on-push", "abort"],
    )
    gw = _gateway(tmp_path_factory, "gw-abort", url)
    yield url, gw, {"0": resolve_model("tiny")}
    gw.stop()
    children.stop(proc)


def engine_stats(url: str) -> dict:
    return httpx.get(f"{url}/engine_stats", headers=engine_keys.auth_headers(url), timeout=10).json()


def stream(gw, session: str, user: str, **kwargs):
    client = openai.OpenAI(
        api_key=API_KEY, base_url=SessionId(session).base_url(gw.reverse_url, "/v1"), max_retries=0
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return client.chat.completions.create(
        model="gpt-4.1", messages=messages, stream=True, temperature=1.0, **kwargs
    )


def test_an_aborted_stream_is_resumed_into_one_unbroken_answer_and_one_record(aborting):
    engine_url, gw, checkpoint_of = aborting
    old_version = max(checkpoint_of, key=int)
    new_weights = resolve_model("tiny", seed=1 if checkpoint_of[old_version] == resolve_model("tiny") else 0)
    session = f"abort-{uuid.uuid4().hex[:6]}"
    chunks, pushed, pusher = [], {}, None
    for chunk in stream(gw, session, USER_TEXT, tools=TOOLS):
        chunks.append(chunk)
        texts = [c for c in chunks if c.choices and (c.choices[0].delta.content or "")]
        if pusher is None and len(texts) == 2:  # mid-text, before the tool call is written
            pusher = threading.Thread(target=lambda: pushed.update(v=push_weights(engine_url, new_weights)))
            pusher.start()
    assert pusher is not None
    pusher.join(60)
    checkpoint_of[pushed["v"]] = new_weights
    content, calls = join_chat_stream(chunks)
    assert content == "Let me write the file."  # every token once, in order, across the abort
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("shell", {"command": "echo hello > out.txt"})
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]

    [row] = _records(gw, session)
    assert row["error"] is None and row["finish_reason"] == "tool_calls"
    aborted = [g for g in engine_stats(engine_url)["recent"] if g["request_id"] == row["request_id"]]
    assert [g["finish_reason"] for g in aborted] == ["abort"]  # the first part, ended by the push
    k = aborted[0]["completion_tokens"]
    assert row["version_spans"] == [
        {"start": 0, "version": old_version},
        {"start": k, "version": pushed["v"]},
    ]
    assert json.loads(row["engine_meta_json"])["resumed"] == 1
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(resolve_model("tiny"))
    assert tokenizer.decode(row["completion_ids"][:-1]).startswith(SCRIPT[0]["text"])  # nothing twice
    ids = row["prompt_ids"] + row["completion_ids"]
    start, recorded = len(row["prompt_ids"]), torch.tensor(row["completion_logprobs"])
    after = fresh_logprobs(new_weights, ids, start + k, row["temperature"])
    before = fresh_logprobs(checkpoint_of[old_version], ids[: start + k], start, row["temperature"])
    assert float((recorded[k:] - after).abs().max()) <= 1e-5
    assert float((recorded[:k] - before).abs().max()) <= 1e-5


def test_a_call_aborted_a_fourth_time_ends_as_an_engine_error(aborting):
    engine_url, gw, checkpoint_of = aborting
    session = f"abort4-{uuid.uuid4().hex[:6]}"
    seen, started, pushes, error = 0, 0, [], None
    pusher: threading.Thread | None = None

    def push(weights) -> None:
        version = push_weights(engine_url, weights)
        checkpoint_of[version] = weights
        pushes.append(version)

    try:
        for chunk in stream(gw, session, COUNT):
            seen += bool(chunk.choices and chunk.choices[0].delta.content)
            idle = pusher is None or not pusher.is_alive()
            if idle and started < 4 and seen >= 3 * (started + 1):  # each push a few tokens into a new part
                pusher = threading.Thread(target=push, args=(resolve_model("tiny", seed=started % 2 + 1),))
                pusher.start()
                started += 1
    except openai.APIError as exc:  # the in-stream error event
        error = exc
    assert pusher is not None
    pusher.join(60)
    assert len(pushes) == 4 and error is not None, (pushes, error)
    [row] = _records(gw, session)
    assert row["error"].startswith("engine_error: the engine aborted the call 4 times")
    assert "gave up after 3 resumes" in row["error"]
    parts = [g for g in engine_stats(engine_url)["recent"] if g["request_id"].startswith(row["request_id"])]
    assert [g["finish_reason"] for g in parts] == ["abort"] * 4


def test_an_aborted_whole_answer_is_resumed_before_the_harness_sees_it(aborting):
    """The same abort on a call the harness does not stream: the gateway resumes it and joins the parts, so the
    SDK gets one answer (the text, then the tool call written after the abort) and the record one span a part."""
    engine_url, gw, checkpoint_of = aborting
    old_version = max(checkpoint_of, key=int)
    new_weights = resolve_model("tiny", seed=1 if checkpoint_of[old_version] == resolve_model("tiny") else 0)
    session = f"abort-whole-{uuid.uuid4().hex[:6]}"
    client = openai.OpenAI(
        api_key=API_KEY, base_url=SessionId(session).base_url(gw.reverse_url, "/v1"), max_retries=0
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TEXT}]
    answer: dict = {}
    caller = threading.Thread(
        target=lambda: answer.update(
            r=client.chat.completions.create(model="gpt-4.1", messages=messages, tools=TOOLS, temperature=1.0)
        )
    )
    caller.start()
    deadline = time.monotonic() + 60
    while not any(n >= 3 for n in engine_stats(engine_url)["running"].values()):  # a few tokens in
        assert caller.is_alive() and time.monotonic() < deadline, "the call never ran long enough"
        time.sleep(0.02)
    version = push_weights(engine_url, new_weights)
    checkpoint_of[version] = new_weights
    caller.join(60)
    [choice] = answer["r"].choices
    assert choice.message.content == "Let me write the file." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("shell", {"command": "echo hello > out.txt"})
    ]

    [row] = _records(gw, session)
    assert row["error"] is None and row["finish_reason"] == "tool_calls" and not row["stream"]
    [first] = [g for g in engine_stats(engine_url)["recent"] if g["request_id"] == row["request_id"]]
    k = first["completion_tokens"]
    assert first["finish_reason"] == "abort" and k >= 3
    assert row["weight_version"] == old_version
    assert row["version_spans"] == [{"start": 0, "version": old_version}, {"start": k, "version": version}]
    assert json.loads(row["engine_meta_json"])["resumed"] == 1
    ids = row["prompt_ids"] + row["completion_ids"]
    start, recorded = len(row["prompt_ids"]), torch.tensor(row["completion_logprobs"])
    after = fresh_logprobs(new_weights, ids, start + k, row["temperature"])
    before = fresh_logprobs(checkpoint_of[old_version], ids[: start + k], start, row["temperature"])
    assert float((recorded[k:] - after).abs().max()) <= 1e-5
    assert float((recorded[:k] - before).abs().max()) <= 1e-5
