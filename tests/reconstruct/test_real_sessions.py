"""Merge on the real harness/SDK sessions recorded through the gateway (sample_flows/records/*.parquet)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_mitm.reconstruct.merge import merge
from polar_mitm.reconstruct.prefix_merging import build_prefix_merging, polar_routing
from polar_mitm.reconstruct.turns import prepare_session, turns_from_table
from tests.reconstruct.test_properties import naive_prefix_merging

RECORDS = Path(__file__).resolve().parents[2] / "sample_flows" / "records"
SHARDS = sorted(RECORDS.glob("*.parquet"))
pytestmark = pytest.mark.skipif(not SHARDS, reason="no recorded sessions in sample_flows/records/")


@pytest.fixture(scope="module")
def sessions() -> dict[str, list]:
    table = pa.concat_tables(pq.read_table(p) for p in SHARDS)
    by_session = defaultdict(list)
    for turn in turns_from_table(table):
        by_session[turn.session_id].append(turn)
    return dict(by_session)


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    out = tmp_path_factory.mktemp("merged")
    summary = merge([str(RECORDS)], str(out))  # invariants are checked on every session; end-of-turn detected
    return summary, pq.read_table(out)


def test_real_sessions_merge_token_faithfully_and_lose_nothing(merged, sessions):
    summary, table = merged
    kept = sum(len(prepare_session(turns)[0]) for turns in sessions.values())
    assert summary.trainable_records == kept == sum(table["n_turns"].to_pylist())
    assert summary.sessions == len(sessions) and summary.sequences <= kept


def test_real_sessions_route_like_a_naive_scan(merged, sessions):
    eot = merged[0].eot_token_id
    for turns in sessions.values():
        kept, _ = prepare_session(turns)
        rows = [
            {
                "request_id": t.request_id,
                "session_id": t.session_id,
                "seq": t.seq,
                "finish_reason": t.finish_reason,
                "prompt_ids": t.prompt_ids.tolist(),
                "completion_ids": t.completion_ids.tolist(),
                "completion_logprobs": t.completion_logprobs.tolist(),
            }
            for t in kept
        ]
        got = [s.request_ids for s in build_prefix_merging(kept, eot_token_id=eot).sequences]
        assert got == naive_prefix_merging(rows, eot)


def test_sessions_polar_keeps_whole_become_one_sequence(merged, sessions):
    """Where Polar's routing never breaks, prefix_merging must give the same single sequence."""
    summary, table = merged
    by_session = defaultdict(list)
    for session_id, request_ids in zip(
        table["session_id"].to_pylist(), table["request_ids"].to_pylist(), strict=True
    ):
        by_session[session_id].append(request_ids)
    whole = 0
    for session_id, turns in sessions.items():
        kept, _ = prepare_session(turns)
        polar = polar_routing(kept, eot_token_id=summary.eot_token_id)
        if kept and not polar.dropped:
            whole += 1
            assert by_session[session_id] == [polar.chain]
    assert whole, "expected at least one session that extends turn by turn"
