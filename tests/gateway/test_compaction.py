"""Compaction: Codex's remote `/responses/compact` served from the engine and recorded; merge and the gateway's
token-exact chains both start a new chain after it, with the reason "compaction"; nothing is dropped. Codex's
remote compaction v2 (a `/responses` call whose input ends with a `compaction_trigger` item) answered with exactly
one compaction item, plain and streamed (replay SSE and live), and recorded as a compaction.

Runs against the shared scripted gateway (tokens mode): turn 1 calls `shell`, the compaction's summary is the
script's next turn, and the thread goes on from the summary.
"""

from __future__ import annotations

import json
import uuid

import httpx
import numpy as np
import openai
import pyarrow as pa
import pytest
from openai._streaming import SSEDecoder
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from polar_mitm.codecs.live import Delta, StreamHead, live_stream
from polar_mitm.codecs.openai_responses import COMPACT_INSTRUCTION, OpenAIResponsesCodec, unseal_reasoning
from polar_mitm.conversation import Completion, Conversation, Message, Tool
from polar_mitm.gateway.call_kind import call_kind
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.reconstruct.prefix_merging import BREAK_COMPACTION, BREAK_NO_PREFIX, build_prefix_merging
from polar_mitm.reconstruct.turns import TurnRecord, sequences_from_table
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import RECORD_SCHEMA, read_all

TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a shell command",
        "strict": False,
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]


def post(base: str, path: str, body: dict) -> dict:
    answer = httpx.post(f"{base}{path}", json=body, headers={"authorization": "Bearer sk-test"}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_codex_remote_compaction_is_sampled_recorded_and_starts_a_new_chain(gateway, tiny_engine):
    session = f"compact-{uuid.uuid4().hex[:8]}"
    base = SessionId(session).base_url(gateway.reverse_url, "/v1")
    items: list = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Write hello"}]}
    ]
    first = post(base, "/responses", {"model": "gpt-5-codex", "input": items, "tools": TOOLS, "store": False})
    calls = [o for o in first["output"] if o["type"] == "function_call"]
    assert calls
    items += calls + [{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "ok"}]

    compacted = post(
        base,
        "/responses/compact",
        {"model": "gpt-5-codex", "input": items, "tools": TOOLS, "instructions": "You are Codex."},
    )
    assert compacted["object"] == "response.compaction"
    summary_item = compacted["output"][-1]
    assert summary_item["type"] == "compaction"
    summary = unseal_reasoning(summary_item["encrypted_content"])
    assert summary  # the engine's sampled text

    after = [
        *compacted["output"],
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on"}]},
    ]
    post(base, "/responses", {"model": "gpt-5-codex", "input": after, "tools": TOOLS, "store": False})

    rows = sorted(
        (r for r in read_all(gateway.out_dir).to_pylist() if r["session_id"] == session),
        key=lambda r: r["seq"],
    )
    assert [r["call_kind"] for r in rows] == ["main", "compaction", "main"]
    assert all(r["status_code"] == 200 and r["completion_ids"] for r in rows)
    assert rows[1]["provider"] == "openai_responses" and rows[1]["path"].endswith("/responses/compact")
    assert tiny_engine.tokenizer.decode(rows[1]["completion_ids"], skip_special_tokens=True) == summary
    assert summary in rows[2]["messages_json"]  # the thread continues from the sampled summary
    # The gateway's token-exact chains name the new chain after the compaction, as merge does.
    assert rows[2]["spliced_turns"] == 0 and rows[2]["splice_reason"] == "compaction"

    table, result = merge_table(
        pa.Table.from_pylist(rows, schema=RECORD_SCHEMA),
        eot_token_id=tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    sequences = sequences_from_table(table)
    assert result.breaks.get(BREAK_COMPACTION) == 1
    assert sorted(rid for s in sequences for rid in s.request_ids) == sorted(r["request_id"] for r in rows)
    assert len(sequences) >= 2


def turn(seq: int, prompt: list[int], kind: str = "main") -> TurnRecord:
    ids = np.asarray(prompt, dtype=np.int32)
    return TurnRecord(
        request_id=f"r{seq}",
        session_id="s",
        seq=seq,
        finish_reason="stop",
        prompt_ids=ids,
        completion_ids=np.asarray([7, 9], dtype=np.int32),
        completion_logprobs=np.asarray([-0.5, -0.1], dtype=np.float32),
        call_kind=kind,
    )


def test_merge_names_the_break_after_a_compaction():
    eot = 9
    turns = [
        turn(0, [1, 2]),
        turn(1, [1, 2, 7, 9, 3]),
        turn(2, [1, 2, 7, 9, 3, 7, 9, 4], "compaction"),
        turn(3, [1, 5, 6]),
        turn(4, [1, 5, 6, 7, 9, 8]),
        turn(5, [2, 2, 2]),
    ]
    result = build_prefix_merging(turns, eot_token_id=eot)
    # Before: turns 0-2 (the compaction extends the thread it summarises); after: 3-4; then an unrelated thread.
    assert [s.request_ids for s in result.sequences] == [["r0", "r1", "r2"], ["r3", "r4"], ["r5"]]
    assert result.breaks == {BREAK_COMPACTION: 1, BREAK_NO_PREFIX: 1}


def test_call_kind_tells_compaction_side_and_main():
    shell = [Tool(name="shell")]
    main = Conversation(messages=[Message(role="user", content="fix the bug")], tools=shell)
    side = Conversation(messages=[Message(role="user", content="Generate a title")])
    claude = Conversation(
        messages=[
            Message(
                role="user",
                content="Your task is to create a detailed summary of "
                "the conversation so far, paying close attention",
            )
        ]
    )
    assert call_kind(main, "/v1/responses") == "main"
    assert call_kind(side, "/v1/chat/completions") == "side"
    assert call_kind(claude, "/v1/messages") == "compaction"
    assert call_kind(main, "/backend-api/codex/responses/compact") == "compaction"
    hermes = Conversation(  # tool-free, so `side` without its marker (Hermes 0.19.0's summariser preamble)
        messages=[
            Message(role="user", content="You are a summarization agent creating a context checkpoint. Treat")
        ]
    )
    assert call_kind(hermes, "/v1/chat/completions") == "compaction"
    openhands = Conversation(  # its condenser's one tool-free user message (openhands-sdk 1.21.0)
        messages=[
            Message(
                role="user",
                content="You are maintaining a context-aware state summary for an interactive agent.\n"
                "You will be given a list of events",
            )
        ]
    )
    assert call_kind(openhands, "/v1/chat/completions") == "compaction"


# ---- remote compaction v2: a compaction_trigger item ends a /responses input ------------------------------------

CODEC = OpenAIResponsesCodec()
EVENT = TypeAdapter(ResponseStreamEvent)
SUMMARY = "The user wants hello in out.txt; the shell call wrote it. Left: nothing."
THREAD = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Write hello"}]},
    {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": "echo hi"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "hi"},
]
V2_BODY = {
    "model": "gpt-5-codex",
    "instructions": "You are Codex.",
    "input": [*THREAD, {"type": "compaction_trigger"}],
    "tools": TOOLS,
    "tool_choice": "auto",
    "stream": True,
    "store": False,
    "include": ["reasoning.encrypted_content"],
}


def summary_completion(finish_reason: str = "stop") -> Completion:
    return Completion(
        id="chatcmpl-0b5c2d9e41f8",
        model="engine",
        content=SUMMARY,
        reasoning=None,
        tool_calls=[],
        finish_reason=finish_reason,
        prompt_ids=list(range(30)),  # type: ignore[arg-type]
        completion_ids=list(range(500, 512)),
        completion_logprobs=[-0.5] * 12,
    )


def sse(data: bytes) -> list[dict]:
    events = [json.loads(event.data) for event in SSEDecoder().iter_bytes(iter([data]))]
    for event in events:
        EVENT.validate_python(event)  # every event is one the official SDK knows
    return events


def assert_one_compaction(response: dict) -> None:
    Response.model_validate(response)
    assert [item["type"] for item in response["output"]] == ["compaction"]
    assert unseal_reasoning(response["output"][0]["encrypted_content"]) == SUMMARY


def test_compaction_trigger_decodes_to_a_summary_request_with_no_tools():
    conv = CODEC.decode_request(V2_BODY, "/v1/responses", {})
    assert conv.compaction and conv.stream and conv.tool_choice == "none"
    assert conv.messages[-1] == Message(role="user", content=COMPACT_INSTRUCTION)
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "tool", "user"]
    assert "tools" not in conv.to_engine_request()  # the summary is text
    assert call_kind(conv, "/v1/responses") == "compaction"
    # A trigger anywhere but last means nothing; without it the call is a normal turn.
    mid = CODEC.decode_request(
        {**V2_BODY, "input": [{"type": "compaction_trigger"}, *THREAD]}, "/v1/responses", {}
    )
    assert not mid.compaction and call_kind(mid, "/v1/responses") == "main"


def test_compaction_answer_is_one_compaction_item_whole_and_replayed():
    conv = CODEC.decode_request(V2_BODY, "/v1/responses", {})
    completion = summary_completion()
    assert_one_compaction(CODEC.encode_response(conv, completion))
    events = sse(b"".join(CODEC.encode_stream(conv, completion)))
    kinds = [event["type"] for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.compaction.compacting",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[4]["item"]["type"] == "compaction" and events[2]["item"]["id"] == events[4]["item"]["id"]
    assert_one_compaction(events[-1]["response"])
    assert SUMMARY not in b"".join(CODEC.encode_stream(conv, completion)).decode()  # only sealed


def test_compaction_answer_streams_live_as_one_compaction_item():
    conv = CODEC.decode_request(V2_BODY, "/v1/responses", {})
    encoder = live_stream("openai_responses", conv, StreamHead(id="chatcmpl-0b5c2d9e41f8", model="engine"))
    data = encoder.start()
    for piece in (SUMMARY[:20], SUMMARY[20:]):
        data += encoder.delta(Delta("text", piece))
    data += encoder.finish(summary_completion())
    events = sse(data)
    kinds = [event["type"] for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.compaction.compacting",
        "response.compaction.compacting",
        "response.output_item.done",
        "response.completed",
    ]
    assert SUMMARY[:20] not in data.decode()
    assert_one_compaction(events[-1]["response"])
    assert events[-2]["item"] == events[-1]["response"]["output"][0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_remote_compaction_v2_through_the_gateway_with_the_openai_sdk(gateway, tiny_engine, stream):
    session = f"compact-v2-{uuid.uuid4().hex[:8]}"
    client = openai.OpenAI(
        api_key="sk-test",
        base_url=SessionId(session).base_url(gateway.reverse_url, "/v1"),
        max_retries=0,
        timeout=120,
    )
    items: list = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Write hello"}]}
    ]
    first = client.responses.create(model="gpt-5-codex", input=items, tools=TOOLS, store=False)
    calls = [o.model_dump() for o in first.output if o.type == "function_call"]
    assert calls
    items += calls + [{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "ok"}]

    body = {
        "model": "gpt-5-codex",
        "input": [*items, {"type": "compaction_trigger"}],
        "tools": TOOLS,
        "store": False,
        "instructions": "You are Codex.",
    }
    if stream:
        events = list(client.responses.create(**body, stream=True))
        kinds = [event.type for event in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.output_item.done") == 1
        compacted = events[-1].response
    else:
        compacted = client.responses.create(**body)
    assert [item.type for item in compacted.output] == ["compaction"]
    summary = unseal_reasoning(compacted.output[0].encrypted_content)
    assert summary  # the engine's sampled text

    after = [
        compacted.output[0].model_dump(exclude_none=True),
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on"}]},
    ]
    client.responses.create(model="gpt-5-codex", input=after, tools=TOOLS, store=False)

    rows = sorted(
        (r for r in read_all(gateway.out_dir).to_pylist() if r["session_id"] == session),
        key=lambda r: r["seq"],
    )
    assert [r["call_kind"] for r in rows] == ["main", "compaction", "main"]
    assert all(r["status_code"] == 200 and r["completion_ids"] for r in rows)
    assert rows[1]["stream"] is stream and rows[1]["path"].endswith("/v1/responses")
    assert COMPACT_INSTRUCTION in rows[1]["messages_json"]
    assert tiny_engine.tokenizer.decode(rows[1]["completion_ids"], skip_special_tokens=True) == summary
    later = json.loads(rows[2]["messages_json"])
    assert later[0] == {**later[0], "role": "user", "content": summary}  # the thread goes on from the summary
    assert rows[2]["splice_reason"] == "compaction"
