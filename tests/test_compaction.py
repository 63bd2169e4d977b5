"""Compaction: Codex's remote `/responses/compact` served from the engine and recorded; merge and the gateway's
token-exact chains both start a new chain after it, with the reason "compaction"; nothing is dropped.

Runs against the shared scripted gateway (tokens mode): turn 1 calls `shell`, the compaction's summary is the
script's next turn, and the thread goes on from the summary.
"""

from __future__ import annotations

import uuid

import httpx
import numpy as np
import pyarrow as pa

from polar_mitm.codecs.openai_responses import unseal_reasoning
from polar_mitm.conversation import Conversation, Message, Tool
from polar_mitm.gateway.call_kind import call_kind
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.reconstruct.prefix_merging import BREAK_COMPACTION, BREAK_NO_PREFIX, build_prefix_merging
from polar_mitm.reconstruct.turns import TurnRecord, sequences_from_table
from polar_mitm.records import RECORD_SCHEMA
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import read_all

TOOLS = [{"type": "function", "name": "shell", "description": "Run a shell command", "strict": False,
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]


def post(base: str, path: str, body: dict) -> dict:
    answer = httpx.post(f"{base}{path}", json=body, headers={"authorization": "Bearer sk-test"}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_codex_remote_compaction_is_sampled_recorded_and_starts_a_new_chain(gateway, tiny_engine):
    session = f"compact-{uuid.uuid4().hex[:8]}"
    base = SessionId(session).base_url(gateway.reverse_url, "/v1")
    items: list = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Write hello"}]}]
    first = post(base, "/responses", {"model": "gpt-5-codex", "input": items, "tools": TOOLS, "store": False})
    calls = [o for o in first["output"] if o["type"] == "function_call"]
    assert calls
    items += calls + [{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "ok"}]

    compacted = post(base, "/responses/compact", {"model": "gpt-5-codex", "input": items, "tools": TOOLS,
                                                  "instructions": "You are Codex."})
    assert compacted["object"] == "response.compaction"
    summary_item = compacted["output"][-1]
    assert summary_item["type"] == "compaction"
    summary = unseal_reasoning(summary_item["encrypted_content"])
    assert summary  # the engine's sampled text

    after = [*compacted["output"],
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on"}]}]
    post(base, "/responses", {"model": "gpt-5-codex", "input": after, "tools": TOOLS, "store": False})

    rows = sorted((r for r in read_all(gateway.out_dir).to_pylist() if r["session_id"] == session),
                  key=lambda r: r["seq"])
    assert [r["call_kind"] for r in rows] == ["main", "compaction", "main"]
    assert all(r["status_code"] == 200 and r["completion_ids"] for r in rows)
    assert rows[1]["provider"] == "openai_responses" and rows[1]["path"].endswith("/responses/compact")
    assert tiny_engine.tokenizer.decode(rows[1]["completion_ids"], skip_special_tokens=True) == summary
    assert summary in rows[2]["messages_json"]  # the thread continues from the sampled summary
    # The gateway's token-exact chains name the new chain after the compaction, as merge does.
    assert rows[2]["spliced_turns"] == 0 and rows[2]["splice_reason"] == "compaction"

    table, result = merge_table(pa.Table.from_pylist(rows, schema=RECORD_SCHEMA),
                                eot_token_id=tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    sequences = sequences_from_table(table)
    assert result.breaks.get(BREAK_COMPACTION) == 1
    assert sorted(rid for s in sequences for rid in s.request_ids) == sorted(r["request_id"] for r in rows)
    assert len(sequences) >= 2


def turn(seq: int, prompt: list[int], kind: str = "main") -> TurnRecord:
    ids = np.asarray(prompt, dtype=np.int32)
    return TurnRecord(request_id=f"r{seq}", session_id="s", seq=seq, finish_reason="stop", prompt_ids=ids,
                      completion_ids=np.asarray([7, 9], dtype=np.int32),
                      completion_logprobs=np.asarray([-0.5, -0.1], dtype=np.float32), call_kind=kind)


def test_merge_names_the_break_after_a_compaction():
    eot = 9
    turns = [turn(0, [1, 2]), turn(1, [1, 2, 7, 9, 3]), turn(2, [1, 2, 7, 9, 3, 7, 9, 4], "compaction"),
             turn(3, [1, 5, 6]), turn(4, [1, 5, 6, 7, 9, 8]), turn(5, [2, 2, 2])]
    result = build_prefix_merging(turns, eot_token_id=eot)
    # Before: turns 0-2 (the compaction extends the thread it summarises); after: 3-4; then an unrelated thread.
    assert [s.request_ids for s in result.sequences] == [["r0", "r1", "r2"], ["r3", "r4"], ["r5"]]
    assert result.breaks == {BREAK_COMPACTION: 1, BREAK_NO_PREFIX: 1}


def test_call_kind_tells_compaction_side_and_main():
    shell = [Tool(name="shell")]
    main = Conversation(messages=[Message(role="user", content="fix the bug")], tools=shell)
    side = Conversation(messages=[Message(role="user", content="Generate a title")])
    claude = Conversation(messages=[Message(role="user", content="Your task is to create a detailed summary of "
                                                                 "the conversation so far, paying close attention")])
    assert call_kind(main, "/v1/responses") == "main"
    assert call_kind(side, "/v1/chat/completions") == "side"
    assert call_kind(claude, "/v1/messages") == "compaction"
    assert call_kind(main, "/backend-api/codex/responses/compact") == "compaction"
