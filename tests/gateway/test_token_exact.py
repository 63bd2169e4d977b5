"""Token-exact prompts (`polar_prompt_mode=tokens`): every sampled token is trained in the context it was sampled in.

A client written with the official openai SDK behaves like Pi / Qwen Code / Gemini CLI: it drops the reasoning
of earlier turns and re-serialises tool-call arguments compactly. Against the scripted tiny engine (turn 1
thinks, three shell calls, a final answer) through real gateways in both prompt modes we check the records, the
merged sequences, the context-fidelity measure, and — with the same weights — that a forward pass over each
merged sequence gives back the recorded behaviour logprobs (what the trainer's step 0 sees).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from polar_mitm.engines import processes as engine_processes
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.gateway.token_chains import ANSWER_DIFFERS, NO_CHAIN, NO_PREFIX, RENDERER_MISMATCH, RETRY
from polar_mitm.processes import children
from polar_mitm.reconstruct.fidelity import sequence_fidelity
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.reconstruct.turns import sequences_from_table
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import RECORD_SCHEMA, read_all

THINKING = "I should look before I write anything."
SCRIPT = {
    "turns": [
        {
            "text": f"<think>\n{THINKING}\n</think>\n\nRunning `ls -la`.",
            "tool_call": {"name": "shell", "arguments": {"command": "ls -la", "timeout": 10}},
        },
        {
            "text": "Now the file.",
            "tool_call": {"name": "shell", "arguments": {"command": "echo hi > out.txt"}},
        },
        {"text": "Checking it.", "tool_call": {"name": "shell", "arguments": {"command": "cat out.txt"}}},
        "Done: out.txt says hi.",
    ]
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"],
            },
        },
    }
]
PROMPT = "Write hi into out.txt and check it."


# -- processes ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exact_engine_url(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("token-exact-engine")
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    proc, url = engine_processes.start_engine(
        "tiny", log=root / "engine.log", extra_args=["--script", str(script)]
    )
    yield url
    children.stop(proc)


def start_gateway(engine_url: str, root: Path, **options: str) -> gateway_processes.GatewayProcess:
    root.mkdir(parents=True, exist_ok=True)
    return gateway_processes.start_gateway(
        engine_url, root / "flows", confdir=root / "conf", log=root / "gateway.log", options=options
    )


@pytest.fixture(scope="module")
def gateways(exact_engine_url, tmp_path_factory):
    """One gateway per prompt mode, in front of the same scripted engine."""
    root = tmp_path_factory.mktemp("token-exact-gateways")
    started = {
        mode: start_gateway(exact_engine_url, root / mode, polar_prompt_mode=mode)
        for mode in ("tokens", "messages")
    }
    yield started
    for gw in started.values():
        gw.stop()


# -- an SDK agent that rewrites its history the way several harnesses do --------------------------------------------


def client_for(gw: gateway_processes.GatewayProcess, session: str):
    from openai import OpenAI

    return OpenAI(
        base_url=SessionId(session).base_url(gw.reverse_url, "/v1"),
        api_key="sk-test",
        max_retries=0,
        timeout=120,
    )


def assistant_copy(message, *, compact: bool) -> dict[str, Any]:
    """The assistant turn as the client sends it back: reasoning dropped, arguments re-serialised."""
    calls = []
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        text = json.dumps(args, separators=(",", ":")) if compact else call.function.arguments
        calls.append(
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": text}}
        )
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if calls:
        out["tool_calls"] = calls
    return out


def run_agent(
    client, messages: list[dict[str, Any]] | None = None, *, compact: bool = True, max_turns: int = 6
) -> list[dict[str, Any]]:
    """Turns until the model stops calling tools; tool results are canned. Returns the final history."""
    messages = messages or [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": PROMPT},
    ]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=1.0)
        message = reply.choices[0].message
        messages.append(assistant_copy(message, compact=compact))
        if not message.tool_calls:
            return messages
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"ok: {call.function.name}"})
    return messages


def session_records(gw: gateway_processes.GatewayProcess, session: str) -> pa.Table:
    rows = [r for r in read_all(gw.out_dir).to_pylist() if r["session_id"] == session]
    return pa.Table.from_pylist(sorted(rows, key=lambda r: r["seq"]), schema=RECORD_SCHEMA)


def merged(records: pa.Table, eot_id: int):
    table, summary = merge_table(records, eot_token_id=eot_id)
    return sequences_from_table(table), summary


def fidelity_share(sequences, records: pa.Table) -> float:
    prompts = {r["request_id"]: np.asarray(r["prompt_ids"], dtype=np.int32) for r in records.to_pylist()}
    exact = total = 0
    for seq in sequences:
        f = sequence_fidelity(seq.input_ids, seq.loss_mask, seq.request_ids, prompts)
        exact, total = exact + f.exact_tokens, total + f.sampled_tokens
    return exact / total


def max_logprob_gap(tiny_engine, sequences) -> float:
    """Largest |forward-pass logprob − recorded logprob| over sampled tokens (same weights, T = 1)."""
    worst = 0.0
    for seq in sequences:
        ids = [int(t) for t in seq.input_ids]
        scored = tiny_engine.score(ids[: seq.prompt_len], ids[seq.prompt_len :])
        mask = np.asarray(seq.loss_mask[seq.prompt_len :], dtype=bool)
        recorded = np.asarray(seq.logprobs[seq.prompt_len :])[mask]
        worst = max(worst, float(np.abs(np.asarray(scored)[mask] - recorded).max()))
    return worst


@pytest.fixture(scope="module")
def eot_id(tiny_engine) -> int:
    return tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")


# -- the two modes on the same rewriting client ----------------------------------------------------------------------


def test_tokens_mode_trains_every_sampled_token_in_its_sampling_context(gateways, tiny_engine, eot_id):
    session = f"exact-{uuid.uuid4().hex[:8]}"
    history = run_agent(client_for(gateways["tokens"], session))
    assert history[-1]["content"] == SCRIPT["turns"][-1]
    records = session_records(gateways["tokens"], session)
    rows = records.to_pylist()
    assert len(rows) == 4 and all(r["status_code"] == 200 for r in rows)
    assert [r["prompt_mode"] for r in rows] == ["messages", "tokens", "tokens", "tokens"]
    assert rows[0]["splice_reason"] == NO_CHAIN and [r["splice_reason"] for r in rows[1:]] == [None] * 3
    assert [r["spliced_turns"] for r in rows] == [0, 1, 2, 3]
    for before, after in zip(rows, rows[1:], strict=False):  # the engine saw the sampled ids verbatim
        stream = before["prompt_ids"] + before["completion_ids"]
        assert after["prompt_ids"][: len(stream)] == stream
    # The thinking block stays in the stream although the client dropped it.
    assert THINKING in tiny_engine.tokenizer.decode(rows[1]["prompt_ids"])
    sequences, summary = merged(records, eot_id)
    assert len(sequences) == 1 and sequences[0].n_turns == 4
    assert fidelity_share(sequences, records) == 1.0
    assert summary.context_exact_tokens == summary.context_checked_tokens > 0
    assert max_logprob_gap(tiny_engine, sequences) <= 1e-4


def test_messages_mode_drifts_on_the_same_client(gateways, tiny_engine, eot_id):
    session = f"drift-{uuid.uuid4().hex[:8]}"
    run_agent(client_for(gateways["messages"], session))
    records = session_records(gateways["messages"], session)
    rows = records.to_pylist()
    assert {r["prompt_mode"] for r in rows} == {"messages"} and len(rows) == 4
    assert {r["spliced_turns"] for r in rows} == {None}  # no chain logic: merge uses its own prefix rule
    assert THINKING not in tiny_engine.tokenizer.decode(rows[1]["prompt_ids"])  # the harness's history
    sequences, summary = merged(records, eot_id)
    share = fidelity_share(sequences, records)
    assert share < 1.0, "messages mode should drift for a client that rewrites its history"
    assert summary.context_exact_tokens < summary.context_checked_tokens
    assert max_logprob_gap(tiny_engine, sequences) > 1e-4  # the trainer would see other logprobs


# -- what must not be spliced ----------------------------------------------------------------------------------------


def first_turn(client) -> list[dict[str, Any]]:
    messages = [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": PROMPT},
    ]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    message = reply.choices[0].message
    messages.append(assistant_copy(message, compact=True))
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "ok"})
    return messages


def continue_with(client, messages: list[dict[str, Any]]) -> None:
    client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)


def last_record(gw, session: str) -> dict[str, Any]:
    return session_records(gw, session).to_pylist()[-1]


@pytest.mark.parametrize("edit", ["content", "tool_call", "injected"])
def test_an_edited_assistant_turn_is_never_spliced(gateways, eot_id, edit):
    gw = gateways["tokens"]
    session = f"edit-{edit}-{uuid.uuid4().hex[:8]}"
    client = client_for(gw, session)
    messages = first_turn(client)
    assistant = messages[2]
    if edit == "content":
        assistant["content"] = "Something the model never said."
    elif edit == "tool_call":
        assistant["tool_calls"][0]["function"]["arguments"] = json.dumps({"command": "rm -rf /tmp/x"})
    else:  # an assistant message the model never sampled, injected before the tool result
        messages.insert(3, {"role": "assistant", "content": "Injected."})
    continue_with(client, messages)
    record = last_record(gw, session)
    assert record["prompt_mode"] == "messages" and record["spliced_turns"] == 0
    assert record["splice_reason"].startswith(ANSWER_DIFFERS), record["splice_reason"]
    records = session_records(gw, session)
    sequences, summary = merged(records, eot_id)
    assert len(sequences) == 2 and fidelity_share(sequences, records) == 1.0


def test_retry_reuses_the_exact_prompt_and_the_kept_sample_continues(gateways, eot_id):
    gw = gateways["tokens"]
    session = f"retry-{uuid.uuid4().hex[:8]}"
    client = client_for(gw, session)
    messages = first_turn(client)
    continue_with(client, messages)  # turn 2
    continue_with(client, messages)  # the same request again: a retry
    rows = session_records(gw, session).to_pylist()
    assert rows[2]["splice_reason"] == RETRY and rows[2]["prompt_ids"] == rows[1]["prompt_ids"]
    records = session_records(gw, session)
    sequences, _ = merged(records, eot_id)
    assert fidelity_share(sequences, records) == 1.0


def test_compaction_and_interleaved_threads_get_their_own_chains(gateways, eot_id):
    gw = gateways["tokens"]
    session = f"threads-{uuid.uuid4().hex[:8]}"
    client = client_for(gw, session)
    main = first_turn(client)
    sub = [{"role": "system", "content": "You are a sub-agent."}, {"role": "user", "content": "List files."}]
    reply = client.chat.completions.create(
        model="tiny", messages=sub, tools=TOOLS
    )  # a sub-agent's first call
    sub.append(assistant_copy(reply.choices[0].message, compact=True))
    sub.append({"role": "tool", "tool_call_id": reply.choices[0].message.tool_calls[0].id, "content": "a b"})
    continue_with(client, main)  # main thread turn 2
    continue_with(client, sub)  # sub-agent turn 2
    compacted = [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "Summary so far: the file was written. Check it."},
    ]
    continue_with(client, compacted)  # history rewritten by a compaction
    rows = session_records(gw, session).to_pylist()
    assert [r["prompt_mode"] for r in rows] == ["messages", "messages", "tokens", "tokens", "messages"]
    assert rows[1]["splice_reason"] == NO_PREFIX and rows[4]["splice_reason"] == NO_PREFIX
    records = session_records(gw, session)
    sequences, _ = merged(records, eot_id)
    assert sorted(s.n_turns for s in sequences) == [1, 2, 2]
    assert fidelity_share(sequences, records) == 1.0


@pytest.mark.slow
def test_gateway_restart_opens_a_new_chain_cleanly(exact_engine_url, tmp_path, eot_id):
    session = f"restart-{uuid.uuid4().hex[:8]}"
    gw = start_gateway(exact_engine_url, tmp_path, polar_prompt_mode="tokens")
    try:
        messages = first_turn(client_for(gw, session))
    finally:
        gw.stop()
    gw = start_gateway(exact_engine_url, tmp_path, polar_prompt_mode="tokens")
    try:
        run_agent(client_for(gw, session), messages)
        records = session_records(gw, session)
    finally:
        gw.stop()
    rows = records.to_pylist()
    assert rows[1]["splice_reason"] == NO_CHAIN and rows[1]["seq"] == 1  # numbering went on; chains did not
    assert [r["prompt_mode"] for r in rows[2:]] == ["tokens"] * (len(rows) - 2)
    sequences, _ = merged(records, eot_id)
    assert fidelity_share(sequences, records) == 1.0


@pytest.mark.slow
def test_a_renderer_that_disagrees_with_the_engine_falls_back_to_messages(
    exact_engine_url, tiny_model_dir, tmp_path
):
    """The gateway never trusts its own rendering: a tokenizer whose template differs is caught on call 1."""
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny_model_dir / name).exists():
            (other / name).write_bytes((tiny_model_dir / name).read_bytes())
    template_file = other / "chat_template.jinja"
    config = json.loads((other / "tokenizer_config.json").read_text())
    if template_file.exists():
        template_file.write_text("{{- 'Preamble.\\n' }}" + template_file.read_text())
    else:
        config["chat_template"] = "{{- 'Preamble.\\n' }}" + config["chat_template"]
        (other / "tokenizer_config.json").write_text(json.dumps(config))
    session = f"mismatch-{uuid.uuid4().hex[:8]}"
    gw = start_gateway(
        exact_engine_url, tmp_path / "gw", polar_prompt_mode="tokens", polar_tokenizer=str(other)
    )
    try:
        run_agent(client_for(gw, session))
        rows = session_records(gw, session).to_pylist()
    finally:
        gw.stop()
    assert rows[0]["splice_reason"] == RENDERER_MISMATCH
    assert {r["prompt_mode"] for r in rows} == {"messages"} and all(r["status_code"] == 200 for r in rows)
