"""Weight versions per span of sampled tokens (records v4 `version_spans`, merged v4 `span_starts`/`span_versions`):
merge carries them into absolute positions; records and merged rows written before v4 read as one version."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.reconstruct.merge import merge
from polar_mitm.storage.merged import MergedSequence, MergedShards
from polar_mitm.storage.records import RECORD_SCHEMA, journal_rows_to_table, scan_records
from tests.reconstruct.test_merge import EOT, read_output, session_rows, write_shard


def _with_spans(rows: list[dict]) -> list[dict]:
    """Turn 1 of each session: a push landed after its 2nd sampled token (version 1 → 2)."""
    rows[1]["version_spans"] = [{"start": 0, "version": "1"}, {"start": 2, "version": "2"}]
    rows[1]["weight_version"] = "2"
    return rows


def test_prefix_merging_places_each_span_at_its_token(tmp_path):
    rows = _with_spans(session_rows("s", 3))
    write_shard(tmp_path / "flows" / "records-0001.parquet", rows)
    merge([str(tmp_path / "flows")], str(tmp_path / "merged"), eot_token=str(EOT))
    (seq,) = MergedShards.at(tmp_path / "merged").sequences()
    starts = seq.turn_starts
    assert seq.version_spans() == [(starts[0], "0"), (starts[1], "1"), (starts[1] + 2, "2"), (starts[2], "2")]
    assert (seq.weight_version_min, seq.weight_version_max) == ("0", "2")


def test_per_request_spans_start_after_the_prompt(tmp_path):
    rows = _with_spans(session_rows("s", 2))
    write_shard(tmp_path / "flows" / "records-0001.parquet", rows)
    merge([str(tmp_path / "flows")], str(tmp_path / "merged"), builder="per_request")
    second = read_output(tmp_path / "merged").to_pylist()[1]
    n_prompt = len(rows[1]["prompt_ids"])
    assert second["span_starts"] == [n_prompt, n_prompt + 2] and second["span_versions"] == ["1", "2"]
    assert (second["weight_version_min"], second["weight_version_max"]) == ("1", "2")


def test_a_span_after_the_last_token_is_left_out(tmp_path):
    rows = session_rows("s", 1)
    rows[0]["version_spans"] = [{"start": 0, "version": "0"}, {"start": 4, "version": "1"}]
    write_shard(tmp_path / "flows" / "records-0001.parquet", rows)
    merge([str(tmp_path / "flows")], str(tmp_path / "merged"), builder="per_request")
    (row,) = read_output(tmp_path / "merged").to_pylist()
    assert row["span_versions"] == ["0"] and row["weight_version_max"] == "0"


def test_records_before_v4_read_as_one_span_of_their_version(tmp_path):
    rows = session_rows("s", 2)
    old_schema = pa.schema([f for f in RECORD_SCHEMA if f.name != "version_spans"])
    path = tmp_path / "flows" / "records-0001.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{**r, "schema_version": 3} for r in rows], schema=old_schema), path)
    assert scan_records(tmp_path / "flows").table["version_spans"].to_pylist() == [None, None]
    merge([str(tmp_path / "flows")], str(tmp_path / "merged"), builder="per_request")
    table = read_output(tmp_path / "merged")
    assert table["span_versions"].to_pylist() == [["0"], ["1"]]


def test_merged_rows_before_v4_read_as_one_span_of_their_oldest_version():
    seq = MergedSequence(
        sequence_id="x",
        session_id="s",
        input_ids=[1, 2, 3, 4],
        loss_mask=[0, 0, 1, 1],
        logprobs=[0.0, 0.0, -0.1, -0.2],
        prompt_len=2,
        request_ids=["r"],
        n_turns=1,
        builder="per_request",
        weight_version_min="3",
        weight_version_max="4",
    )
    assert seq.version_spans() == [(2, "3")]


def test_journal_rows_with_spans_convert_strictly():
    (row,) = session_rows("s", 1)
    row["version_spans"] = [{"start": 0, "version": "0"}, {"start": 3, "version": "1"}]
    table = journal_rows_to_table([{**row, "started_at": 0, "finished_at": 1}])
    assert table["version_spans"].to_pylist() == [row["version_spans"]]
