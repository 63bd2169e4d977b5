"""The "compaction" break label goes to the next *main* call that opens a new chain after a compaction call.

Side calls (routing, titles) and further compaction calls (Gemini CLI's verification of its summary) open chains
of their own under their own reason and leave the label for the main call — in merge (over TurnRecords and over
a records table) and in the gateway's token-exact chains alike; records without `call_kind` (schema v2) merge as
before.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa

from polar_mitm.conversation import Completion, Message
from polar_mitm.gateway.token_chains import COMPACTION, NO_CHAIN, NO_PREFIX, RETRY, TokenChains
from polar_mitm.reconstruct.compaction_label import new_chain_reason, pending_after
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.reconstruct.prefix_merging import (
    BREAK_COMPACTION,
    BREAK_NO_PREFIX,
    BREAK_SAME_PROMPT,
    build_prefix_merging,
)
from polar_mitm.reconstruct.turns import TurnRecord
from polar_mitm.storage.records import RECORD_SCHEMA, Record

EOT = 9
T0 = datetime(2026, 1, 1, tzinfo=UTC)

# A main thread (0-1), its compaction (2), a side call (3), the compaction's verification (4: a compaction-kind
# call), the main thread going on from the summary (5-6), then an unrelated main thread (7).
SESSION = [
    ("main", [1, 2]),
    ("main", [1, 2, 7, 9, 3]),
    ("compaction", [1, 2, 7, 9, 3, 7, 9, 4]),
    ("side", [5, 5]),
    ("compaction", [6, 6]),
    ("main", [1, 8, 8]),
    ("main", [1, 8, 8, 7, 9, 3]),
    ("main", [2, 2, 2]),
]


def turn(seq: int, kind: str | None, prompt: list[int]) -> TurnRecord:
    return TurnRecord(
        request_id=f"r{seq}",
        session_id="s",
        seq=seq,
        finish_reason="stop",
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        completion_ids=np.asarray([7, 9], np.int32),
        completion_logprobs=np.asarray([-0.5, -0.1], dtype=np.float32),
        call_kind=kind,
    )


def test_rule():
    assert new_chain_reason(True, "main", "x") == "compaction"
    assert new_chain_reason(True, None, "x") == "compaction"  # schema v2 records: as before
    assert new_chain_reason(True, "side", "x") == "x" and new_chain_reason(True, "compaction", "x") == "x"
    assert new_chain_reason(False, "main", "x") == "x"
    assert pending_after(False, "compaction", opened=True) and pending_after(True, "compaction", opened=False)
    assert pending_after(True, "side", opened=True)  # a side call's new chain leaves the label pending
    assert pending_after(True, "main", opened=False)  # extending a chain, or a retry, leaves it too
    assert not pending_after(True, "main", opened=True) and not pending_after(True, None, opened=True)


def test_merge_gives_the_label_to_the_main_call_not_to_side_or_verification_calls():
    result = build_prefix_merging([turn(i, kind, p) for i, (kind, p) in enumerate(SESSION)], eot_token_id=EOT)
    assert [s.request_ids for s in result.sequences] == [
        ["r0", "r1", "r2"],
        ["r3"],
        ["r4"],
        ["r5", "r6"],
        ["r7"],
    ]
    # side (3), verification (4) and the unrelated thread (7): no prefix match; the main chain after it (5).
    assert result.breaks == {BREAK_NO_PREFIX: 3, BREAK_COMPACTION: 1}


def test_merge_a_retry_after_a_compaction_does_not_take_the_label():
    session = [("main", [1, 2]), ("compaction", [5, 5]), ("main", [1, 2]), ("main", [3, 3])]
    result = build_prefix_merging([turn(i, kind, p) for i, (kind, p) in enumerate(session)], eot_token_id=EOT)
    assert result.breaks == {BREAK_NO_PREFIX: 1, BREAK_SAME_PROMPT: 1, BREAK_COMPACTION: 1}


def records_table(kinds: bool) -> pa.Table:
    rows = [
        Record(
            request_id=f"r{i}",
            session_id="s",
            seq=i,
            started_at=T0 + timedelta(seconds=i),
            finished_at=T0 + timedelta(seconds=i, milliseconds=5),
            provider="openai_chat",
            path="/v1/chat/completions",
            stream=False,
            finish_reason="stop",
            prompt_ids=prompt,
            completion_ids=[7, EOT],
            completion_logprobs=[-0.5, -0.1],
            call_kind=kind if kinds else None,
        ).__dict__
        for i, (kind, prompt) in enumerate(SESSION)
    ]
    table = pa.Table.from_pylist(rows, schema=RECORD_SCHEMA)
    return table if kinds else table.drop_columns(["call_kind"])  # schema v2: no such column


def test_merge_table_counts_the_main_chain_after_a_compaction():
    merged, summary = merge_table(records_table(kinds=True), eot_token_id=EOT)
    assert summary.breaks == {BREAK_NO_PREFIX: 3, BREAK_COMPACTION: 1}
    assert merged.num_rows == 5


def test_merge_table_without_call_kind_counts_no_compaction():
    merged, summary = merge_table(records_table(kinds=False), eot_token_id=EOT)
    assert summary.breaks == {BREAK_NO_PREFIX: 4}
    assert merged.num_rows == 5


# -- the gateway's token-exact chains -------------------------------------------------------------------------------


def render(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def call(chains: TokenChains, kind: str, user: str, ids: list[int]):
    """Plan and commit one single-message call; returns its plan (reason and spliced_turns as recorded)."""
    plan = chains.plan(
        "s", render(user), [Message(role="user", content=user)], lambda text: [0] * len(text), kind
    )
    chains.commit(
        plan,
        Completion(
            id="c",
            model="m",
            content="ok",
            reasoning=None,
            tool_calls=[],
            finish_reason="stop",
            prompt_ids=plan.input_ids or ids,
            completion_ids=[7, EOT],
            completion_logprobs=[-0.5, -0.1],
        ),
    )
    return plan


def test_token_chains_give_the_label_to_the_main_call_not_to_side_or_verification_calls():
    chains = TokenChains(EOT, "<|im_end|>")
    assert call(chains, "main", "fix the bug", [1, 2]).reason == NO_CHAIN
    assert call(chains, "compaction", "summarise the conversation", [1, 3]).reason == NO_PREFIX
    assert call(chains, "side", "route this request", [1, 4]).reason == NO_PREFIX
    assert call(chains, "compaction", "verify the summary", [1, 5]).reason == NO_PREFIX
    resumed = call(chains, "main", "Summary: the bug is in parse()", [1, 6])
    assert (resumed.spliced_turns, resumed.reason) == (0, COMPACTION)
    assert call(chains, "main", "an unrelated thread", [1, 7]).reason == NO_PREFIX  # the label was used up


def test_token_chains_a_retry_after_a_compaction_does_not_take_the_label():
    chains = TokenChains(EOT, "<|im_end|>")
    call(chains, "main", "fix the bug", [1, 2])
    call(chains, "compaction", "summarise the conversation", [1, 3])
    assert call(chains, "main", "fix the bug", [1, 2]).reason == RETRY
    assert call(chains, "main", "Summary: the bug is in parse()", [1, 6]).reason == COMPACTION
