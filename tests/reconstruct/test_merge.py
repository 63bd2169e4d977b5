"""`polar-mitm merge` / `show` / `stats` end to end on Parquet shards: inputs, journal, rewards, determinism."""

from __future__ import annotations

import json
import zlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.reconstruct.merge import MergeError, load_rewards, merge
from polar_mitm.storage.journal_format import FRAME_HEADER, JOURNAL_DIR, JOURNAL_SUFFIX
from polar_mitm.storage.merged import MERGED_SCHEMA
from polar_mitm.storage.records import RECORD_SCHEMA, Record

IM_START, EOT, NL, SYSTEM, USER, ASSISTANT = 151644, 151645, 198, 8948, 872, 77091
GEN = [IM_START, ASSISTANT, NL]
T0 = datetime(2025, 1, 1, tzinfo=UTC)
runner = CliRunner()


def block(role: int, content: list[int]) -> list[int]:
    return [IM_START, role, NL, *content, EOT, NL]


def session_rows(session: str, turns: int, *, task: str | None = None, first_seq: int = 0) -> list[dict]:
    """A session of `turns` calls, each prompt extending the last (real Qwen ids: 'Hello', ' world', …)."""
    rows, history = [], block(SYSTEM, [9707]) + block(USER, [1879, 1052])
    for i in range(turns):
        prompt = history + GEN
        sampled = [9707 + i, 11, 1879, EOT]
        rows.append(
            Record(
                request_id=f"{session}-{i}",
                session_id=session,
                task_id=task,
                seq=first_seq + i,
                started_at=T0 + timedelta(seconds=i),
                finished_at=T0 + timedelta(seconds=i, milliseconds=5),
                provider="openai_chat",
                path="/v1/chat/completions",
                stream=False,
                finish_reason="stop",
                prompt_ids=prompt,
                completion_ids=sampled,
                completion_logprobs=[-0.1 * (j + 1) for j in range(4)],
                weight_version=str(i),
            ).__dict__
        )
        history = prompt + sampled + [NL] + block(USER, [3000 + i])
    return rows


def write_shard(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=RECORD_SCHEMA), path)
    return path


@pytest.fixture
def flows(tmp_path) -> Path:
    """Three sessions spread over two shards, interleaved, plus an error record."""
    a, b, c = (
        session_rows("sess-a", 3, task="t1"),
        session_rows("sess-b", 2, task="t1"),
        session_rows("sess-c", 4),
    )
    error = dict(
        a[1],
        request_id="sess-a-err",
        seq=10,
        finish_reason="error",
        completion_ids=[],
        completion_logprobs=[],
        error="engine_error: down",
    )
    write_shard(tmp_path / "flows" / "records-0001.parquet", [a[0], b[0], c[0], c[1], a[1]])
    write_shard(tmp_path / "flows" / "records-0002.parquet", [b[1], c[2], a[2], error, c[3]])
    return tmp_path / "flows"


def read_output(folder: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in sorted(folder.glob("merged-*.parquet")))


def test_merge_writes_sorted_sequences_and_a_summary(flows, tmp_path):
    out = tmp_path / "merged"
    summary = merge([str(flows)], str(out), eot_token=str(EOT))
    table = read_output(out)
    assert table.schema.equals(MERGED_SCHEMA, check_metadata=False)
    assert table["sequence_id"].to_pylist() == ["sess-a:sess-a-0", "sess-b:sess-b-0", "sess-c:sess-c-0"]
    assert table["n_turns"].to_pylist() == [3, 2, 4]
    assert table["weight_version_min"].to_pylist() == ["0", "0", "0"]
    assert table["weight_version_max"].to_pylist() == ["2", "1", "3"]
    assert (summary.records, summary.sessions, summary.sequences) == (10, 3, 3)
    assert summary.excluded == {"error": 1} and summary.trainable_records == 9
    assert summary.records_per_sequence == 3.0
    assert summary.trainable_tokens == 9 * 4
    saved = json.loads((out / "_summary.json").read_text())
    assert saved["sequences"] == 3 and saved["records_per_sequence"] == 3.0


def test_rerunning_merge_gives_byte_identical_shards(flows, tmp_path):
    merge([str(flows)], str(tmp_path / "one"), eot_token=str(EOT))
    merge([str(flows)], str(tmp_path / "two"), eot_token=str(EOT))
    one, two = sorted((tmp_path / "one").glob("merged-*")), sorted((tmp_path / "two").glob("merged-*"))
    assert [p.name for p in one] == [p.name for p in two] == ["merged-00000.parquet"]
    assert one[0].read_bytes() == two[0].read_bytes()


def test_a_rerun_replaces_the_previous_shards(flows, tmp_path):
    out = tmp_path / "merged"
    merge([str(flows)], str(out), eot_token=str(EOT), flush_tokens=1)  # one shard per session
    assert len(list(out.glob("merged-*.parquet"))) == 3
    merge([str(flows)], str(out), eot_token=str(EOT))
    assert [p.name for p in out.glob("merged-*.parquet")] == ["merged-00000.parquet"]
    assert read_output(out).num_rows == 3


def test_small_shards_hold_every_sequence_once(flows, tmp_path):
    out = tmp_path / "merged"
    summary = merge([str(flows)], str(out), eot_token=str(EOT), flush_tokens=1, batch_rows=2)
    assert len(summary.shards) == 3
    ids = read_output(out)["request_ids"].to_pylist()
    assert sorted(r for group in ids for r in group) == sorted(
        f"sess-{s}-{i}" for s, n in (("a", 3), ("b", 2), ("c", 4)) for i in range(n)
    )


def test_merge_reads_a_file_uri_and_a_single_file(flows, tmp_path):
    by_uri = merge([flows.resolve().as_uri()], str(tmp_path / "uri"), eot_token=str(EOT))
    by_file = merge(
        [str(flows / "records-0001.parquet"), str(flows / "records-0002.parquet")],
        str(tmp_path / "files"),
        eot_token=str(EOT),
    )
    assert by_uri.sequences == by_file.sequences == 3
    assert read_output(tmp_path / "uri").equals(read_output(tmp_path / "files"))


def test_merge_includes_records_still_in_the_live_journal(tmp_path):
    rows = session_rows("live", 3)
    write_shard(tmp_path / "flows" / "records-0001.parquet", rows[:1])
    journal = tmp_path / "flows" / JOURNAL_DIR / f"000001{JOURNAL_SUFFIX}"
    journal.parent.mkdir(parents=True)
    frames = b""
    for r in rows[1:]:
        payload = orjson.dumps(Record.from_row(r).to_journal())
        frames += FRAME_HEADER.pack(len(payload), zlib.crc32(payload)) + payload
    journal.write_bytes(frames)
    summary = merge([str(tmp_path / "flows")], str(tmp_path / "merged"), eot_token=str(EOT))
    assert summary.sequences == 1 and summary.trainable_records == 3


def test_merged_shards_in_the_input_folder_are_skipped(flows, tmp_path):
    merge([str(flows)], str(flows / "merged"), eot_token=str(EOT))
    summary = merge([str(flows)], str(tmp_path / "again"), eot_token=str(EOT))
    assert summary.records == 10
    assert [Path(p).name for p in summary.skipped_files] == ["merged-00000.parquet"]


def test_end_of_turn_is_detected_from_the_records(flows, tmp_path):
    summary = merge([str(flows)], str(tmp_path / "merged"))
    assert summary.eot_token_id == EOT and summary.eot_source == "most common last sampled id"


def test_end_of_turn_text_is_resolved_with_the_tokenizer(flows, tmp_path):
    summary = merge([str(flows)], str(tmp_path / "merged"), eot_token="<|im_end|>", tokenizer="tiny")
    assert summary.eot_token_id == EOT
    with pytest.raises(MergeError, match="--tokenizer"):
        merge([str(flows)], str(tmp_path / "merged"), eot_token="<|im_end|>")


def test_per_request_makes_one_sequence_per_call(flows, tmp_path):
    summary = merge([str(flows)], str(tmp_path / "merged"), builder="per_request")
    table = read_output(tmp_path / "merged")
    assert summary.sequences == table.num_rows == 9 and set(table["n_turns"].to_pylist()) == {1}
    assert summary.eot_token_id is None


# -- rewards -----------------------------------------------------------------------------------------------------


def test_rewards_from_jsonl_are_joined_and_missing_ones_kept_as_null(flows, tmp_path):
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text(
        '{"session_id": "sess-a", "reward": 1.0}\n\n{"session_id": "sess-c", "reward": 0.25, '
        '"task_id": "t2"}\n'
    )
    summary = merge([str(flows)], str(tmp_path / "merged"), eot_token=str(EOT), rewards=str(rewards))
    table = read_output(tmp_path / "merged")
    assert table["reward"].to_pylist() == [1.0, None, 0.25]
    assert table["task_id"].to_pylist() == [
        "t1",
        "t1",
        "t2",
    ]  # filled from the rewards where records had none
    assert (summary.rewarded_sessions, summary.unrewarded_sessions) == (2, 1)


def test_rewards_from_parquet_with_drop_unrewarded(flows, tmp_path):
    rewards = tmp_path / "rewards.parquet"
    pq.write_table(
        pa.table({"session_id": ["sess-b", "sess-c"], "reward": [0.5, None], "status": ["ok", "cut"]}),
        rewards,
    )
    summary = merge(
        [str(flows)], str(tmp_path / "merged"), eot_token=str(EOT), rewards=str(rewards), drop_unrewarded=True
    )
    table = read_output(tmp_path / "merged")
    assert table["session_id"].to_pylist() == ["sess-b"] and table["reward"].to_pylist() == [0.5]
    assert summary.dropped_unrewarded_sequences == 2 and summary.unrewarded_sessions == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"session_id": "a", "reward": 1}\n{"session_id": "a", "reward": 0}\n', "two different rewards"),
        ('{"session_id": "a", "reward": "high"}\n', "finite number"),
        ('{"reward": 1}\n', "session_id"),
        ('{"session_id": "a", "reward": 1}\nnot json\n', "line 2"),
    ],
)
def test_bad_rewards_files_are_rejected_with_the_line(tmp_path, content, message):
    path = tmp_path / "rewards.jsonl"
    path.write_text(content)
    with pytest.raises(MergeError, match=message):
        load_rewards(str(path))


def test_a_reward_for_another_task_is_an_error(flows, tmp_path):
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text('{"session_id": "sess-a", "reward": 1.0, "task_id": "other"}\n')
    with pytest.raises(MergeError, match="task"):
        merge([str(flows)], str(tmp_path / "merged"), eot_token=str(EOT), rewards=str(rewards))


# -- the CLI -----------------------------------------------------------------------------------------------------


def test_cli_merge_show_and_stats(flows, tmp_path):
    out = tmp_path / "merged"
    result = runner.invoke(app, ["merge", str(flows), "-o", str(out), "--eot-token", str(EOT)])
    assert result.exit_code == 0, result.output
    assert "requests / sequence" in result.output and "3.00" in result.output

    shown = runner.invoke(app, ["show", "sess-b", "--data", str(out), "--tokenizer", "none", "--logprobs"])
    assert shown.exit_code == 0, shown.output
    assert "turn 1 · sess-b-0" in shown.output and "turn 2 · sess-b-1" in shown.output
    assert "⁽-0.10⁾" in shown.output

    by_request = runner.invoke(app, ["show", "sess-c-2", "--data", str(out), "--tokenizer", "tiny"])
    assert by_request.exit_code == 0, by_request.output
    assert "sess-c:sess-c-0" in by_request.output and "<|im_start|>user" in by_request.output

    missing = runner.invoke(app, ["show", "nope", "--data", str(out), "--tokenizer", "none"])
    assert missing.exit_code == 1

    stats = runner.invoke(app, ["stats", str(out)])
    assert stats.exit_code == 0, stats.output
    assert "trainable tokens" in stats.output and (out / "stats.png").stat().st_size > 1000
    assert runner.invoke(app, ["show", "sess-a", "--data", str(out), "--tokenizer", "none"]).exit_code == 0


def test_cli_show_and_stats_report_a_folder_without_shards(tmp_path):
    (tmp_path / "nothing").mkdir()
    for args in (["show", "x", "--data", str(tmp_path / "nothing")], ["stats", str(tmp_path / "nothing")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1 and "no merged shards" in result.output


def test_cli_merge_reports_an_empty_input(tmp_path):
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["merge", str(tmp_path / "empty"), "-o", str(tmp_path / "merged")])
    assert result.exit_code == 1 and "no records" in result.output
