"""The session-end vocabulary's decisions (precedence, the last call, an unparsed tool call) and the files that carry
it: rewards rows and merged shards written before `end` existed still read, with `end` null."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_mitm.storage.merged import MERGED_SCHEMA, MergedDataError, MergedSequence, MergedShards
from polar_mitm.storage.rewards import read_rewards, read_rewards_table
from polar_mitm.storage.session_ends import (
    PRECEDENCE,
    EndRule,
    EndRules,
    RecordedCall,
    SessionEnd,
    combine,
    ends_line,
    session_end,
    status_end,
    unparsed_tool_call,
)

CALL_TEXT = '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"\n</tool_call>'


def call(seq: int, finish: str = "stop", error: str | None = None, **extra) -> RecordedCall:
    return RecordedCall(seq=seq, started_at=seq, finish_reason=finish, error=error, **extra)


def test_the_strongest_end_wins_in_the_stated_order():
    assert [str(e) for e in PRECEDENCE] == [
        "cut",
        "cancelled",
        "harness_timeout",
        "engine_error",
        "context_overflow",
        "harness_crash",
        "length",
        "unparsed_tool_call",
        "completed",
    ]
    assert combine("completed", "length", None) == SessionEnd.LENGTH
    assert combine(None, None) is None


def test_a_crash_on_a_failed_call_is_that_failure_and_a_timeout_is_the_timeout():
    overflow = [call(0), call(1, "error", "context_length: The input (600 tokens) is longer than …")]
    assert session_end(status_end("crashed"), overflow) == SessionEnd.CONTEXT_OVERFLOW
    down = [call(0, "error", "overloaded: the engine did not answer")]
    assert session_end(status_end("crashed"), down) == SessionEnd.ENGINE_ERROR
    assert session_end(status_end("timeout"), down) == SessionEnd.HARNESS_TIMEOUT
    assert session_end(status_end("crashed"), [call(0)]) == SessionEnd.HARNESS_CRASH
    assert session_end(status_end("ok"), []) == SessionEnd.COMPLETED


def test_the_last_main_answered_call_decides_and_a_cut_broken_call_is_length():
    # a truncated <tool_call> is the budget's doing
    assert session_end(None, [call(0, "length", unparsed_tool_call=True)]) == SessionEnd.LENGTH
    assert session_end(None, [call(0, unparsed_tool_call=True)]) == SessionEnd.UNPARSED_TOOL_CALL
    # a side call (a title) after the agent's last, and a call the harness hung up on, say nothing
    calls = [call(0, "length"), call(1, call_kind="side"), call(2, "abort", "abort: client went away")]
    assert session_end(None, calls) == SessionEnd.LENGTH
    # a mid-session truncation the harness got past is not the end
    assert session_end(None, [call(0, "length"), call(1)]) == SessionEnd.COMPLETED


def test_an_unparsed_tool_call_is_a_tool_call_left_as_text_in_the_answer_not_in_echoed_instructions():
    chat = {"choices": [{"message": {"role": "assistant", "content": CALL_TEXT}, "finish_reason": "stop"}]}
    assert unparsed_tool_call(json.dumps(chat))
    parsed = {"choices": [{"message": {"tool_calls": [{"function": {"name": "shell", "arguments": "{}"}}]}}]}
    assert not unparsed_tool_call(json.dumps(parsed))
    echoed = {"instructions": "Answer with <tool_call> blocks.", "output": [{"content": [{"text": "Done."}]}]}
    assert not unparsed_tool_call(json.dumps(echoed))
    assert not unparsed_tool_call(None)


def test_rules_keep_zero_or_mask_and_say_what_they_did():
    rules = EndRules({SessionEnd.LENGTH: EndRule.mask, SessionEnd.UNPARSED_TOOL_CALL: EndRule.zero}, -1.0)
    assert rules.reward("length", 1.0) is None
    assert rules.reward("unparsed_tool_call", 1.0) == -1.0
    assert rules.reward("completed", 0.5) == 0.5 and rules.reward("harness_crash", 0.0) == 0.0
    line = ends_line({"length": 2, "unparsed_tool_call": 1, "completed": 3}, {"length:mask": 2})
    assert line == "2 length (2 mask) · 1 unparsed_tool_call"
    assert ends_line({"completed": 3}) == "all completed" and ends_line({}) == "—"


def test_a_rewards_file_without_end_still_reads(tmp_path):
    path = tmp_path / "rewards.parquet"
    pq.write_table(pa.table({"session_id": ["s"], "task_id": ["t"], "reward": [1.0], "status": ["ok"]}), path)
    assert read_rewards_table(path, ["session_id", "end"]).to_pylist() == [{"session_id": "s", "end": None}]
    [(session, reward)] = read_rewards(str(path)).items()
    assert session == "s" and reward.reward == 1.0 and reward.status == "ok" and reward.end is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"session_id": "s", "reward": 1.0, "end": "fine"}) + "\n")
    with pytest.raises(ValueError, match="end 'fine' is none of"):
        read_rewards(str(bad))


def test_a_merged_shard_of_version_4_reads_with_end_null(tmp_path):
    seq = MergedSequence(
        sequence_id="q",
        session_id="s",
        input_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.25],
        prompt_len=1,
        request_ids=["r"],
        n_turns=1,
        builder="per_request",
        schema_version=4,
    )
    row = {k: v for k, v in seq.to_row().items() if k != "end"}
    v4 = pa.schema([f for f in MERGED_SCHEMA if f.name != "end"])
    pq.write_table(pa.Table.from_pylist([row], schema=v4), tmp_path / "merged-00000.parquet")
    [read] = MergedShards.at(tmp_path).sequences()
    assert read.end is None and read.sequence_id == "q"
    seq.end = "finished"
    pq.write_table(
        pa.Table.from_pylist([seq.to_row()], schema=MERGED_SCHEMA), tmp_path / "merged-00000.parquet"
    )
    with pytest.raises(MergedDataError, match="end 'finished' is none of"):
        list(MergedShards.at(tmp_path).sequences())


def test_docs_records_md_lists_every_end_with_its_meaning_in_precedence_order():
    from pathlib import Path

    from polar_mitm.storage.session_ends import MEANINGS

    docs = (Path(__file__).resolve().parents[2] / "docs" / "records.md").read_text()
    rows = [f"| `{end}` | {MEANINGS[end]} |" for end in PRECEDENCE]
    assert all(row in docs for row in rows), [row for row in rows if row not in docs]
    assert [docs.index(row) for row in rows] == sorted(docs.index(row) for row in rows)
