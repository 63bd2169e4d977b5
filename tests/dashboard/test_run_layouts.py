"""The dashboard's queries on small hand-made run directories (no browser, no loop): a rollout service's `--out`
folder and a `loop --service` iteration show their sessions and tasks; Discarded names each session's reason (its
status or its `end`, a flat group, held-out) and the tokens `--max-staleness` masked; a judge's word reaches the
table and the session page; the Engines page marks every push the files tell of; the session table pages, sorts,
filters and searches on the server and is rebuilt when a stage's records change."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.dashboard import calls, figures, timeline
from polar_mitm.dashboard.run_files import stage_named, stages
from polar_mitm.dashboard.sessions import SessionIndex, SessionQuery
from polar_mitm.storage import service_layout
from polar_mitm.storage.journal import RecordWriter
from polar_mitm.storage.judgments import JUDGMENTS_DIR, Judgment, write_judgment, write_summary
from polar_mitm.storage.records import Record
from polar_mitm.storage.rewards import REWARDS_SCHEMA

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def write_records(
    flows: Path, sessions: dict[str, str], prompt: str = "fix the bug", spans: list[dict] | None = None
) -> None:
    """Two calls per session (session id → task id), through the gateway's own writer; `spans`: the second call's
    version spans (a push landed in it)."""
    writer = RecordWriter(flows, fsync=False, compact_in_child=False)
    writer.start()
    for n, (session_id, task_id) in enumerate(sessions.items()):
        for seq in range(2):
            start = T0 + timedelta(seconds=10 * n + 2 * seq)
            record = Record(
                request_id=f"{session_id}-{seq}",
                session_id=session_id,
                task_id=task_id,
                seq=seq,
                started_at=start,
                finished_at=start + timedelta(seconds=1),
                provider="openai_chat",
                path="/v1/chat/completions",
                stream=False,
                finish_reason="stop" if seq else "tool_calls",
                messages_json=json.dumps([{"role": "user", "content": f"{prompt} in {session_id}"}]),
                prompt_ids=[1, 2, 3],
                completion_ids=[4, 5],
                completion_logprobs=[-0.1, -0.2],
                weight_version=str(seq),
                prompt_tokens=3,
                completion_tokens=2,
                version_spans=spans if seq else None,
            )
            writer.write(record.to_journal()).result()
    writer.close()


def session_result(session_id: str, task_id: str, status: str, reward: float | None) -> dict:
    return {
        "session_id": session_id,
        "task_id": task_id,
        "status": status,
        "trajectory": {"status": "COMPLETED", "traces": [{"reward": reward}]},
        "timing": {"init_ms": 100.0, "run_ms": 2000.0, "postrun_ms": 50.0},
    }


def test_a_service_out_folder_shows_its_tasks_and_sessions(tmp_path):
    write_records(tmp_path / "flows", {"s-a": "task-a", "s-b": "task-a"})
    folder = service_layout.task_dir(tmp_path, "task-a")
    folder.mkdir(parents=True)
    (folder / service_layout.REQUEST_FILE).write_text(json.dumps({"task_id": "task-a", "num_samples": 2}))
    (folder / service_layout.STATE_FILE).write_text(json.dumps({"status": "completed"}))
    lines = [
        session_result("s-a", "task-a", "COMPLETED", 1.0),
        session_result("s-b", "task-a", "TIMEOUT", None),
    ]
    (folder / service_layout.RESULTS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))

    assert [s.label for s in stages(tmp_path)] == ["service"]
    rows = {r["session_id"]: r for r in SessionIndex(tmp_path).page(SessionQuery(filters={}))["rows"]}
    assert rows["s-a"]["status"] == "completed" and rows["s-a"]["reward"] == 1.0 and rows["s-a"]["calls"] == 2
    assert rows["s-b"]["status"] == "timeout" and rows["s-a"]["run_seconds"] == 2.0
    assert figures.service(tmp_path)["tasks"] == [
        {
            "task_id": "task-a",
            "status": "completed",
            "sessions_asked": 2,
            "sessions_finished": 2,
            "statuses": {"COMPLETED": 1, "TIMEOUT": 1},
            "reward_mean": 1.0,
        }
    ]


def test_a_loop_service_iteration_shows_the_results_it_was_answered(tmp_path):
    iteration = tmp_path / "iter-0"
    iteration.mkdir()
    lines = [session_result("s-1", "t", "COMPLETED", 0.0), session_result("s-2", "t", "ERROR", None)]
    (iteration / "service_results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = SessionIndex(tmp_path).table().to_pylist()
    assert {(r["session_id"], r["status"]) for r in rows} == {("s-1", "completed"), ("s-2", "error")}
    assert figures.service(tmp_path)["tasks"][0]["statuses"] == {"COMPLETED": 1, "ERROR": 1}


def rewards(path: Path, rows: list[tuple], ends: dict[str, str] | None = None) -> None:
    """A rewards file of (session, task, sample, reward, status) rows, as the rollout writes it; `ends`: each
    session's `end` (absent: a run from before the session-end vocabulary)."""
    names = ("session_id", "task_id", "sample_index", "reward", "status")
    table = pa.Table.from_pylist(
        [{**dict(zip(names, row, strict=True)), "exit_code": 0, "init_seconds": 0.1} for row in rows],
        schema=REWARDS_SCHEMA,
    )
    if "end" in table.column_names:
        table = table.drop_columns(["end"])
    if ends is not None:
        column = pa.array([ends.get(s, "completed") for s in table["session_id"].to_pylist()], pa.string())
        table = table.append_column("end", column)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def iteration_run(run_dir: Path, ends: dict[str, str] | None = None) -> None:
    sessions = {f"{task}-{i}": task for task in ("flat", "mixed", "broken") for i in range(2)}
    write_records(run_dir / "iter-0" / "flows", sessions)
    outcomes = [
        ("flat-0", "flat", 0, 1.0, "ok"),
        ("flat-1", "flat", 1, 1.0, "ok"),
        ("mixed-0", "mixed", 0, 1.0, "ok"),
        ("mixed-1", "mixed", 1, 0.0, "failed"),
        ("broken-0", "broken", 0, None, "timeout"),
        ("broken-1", "broken", 1, None, "cut"),
    ]
    rewards(run_dir / "iter-0" / "rewards.parquet", outcomes, ends)
    write_records(run_dir / "eval-0" / "flows", {"held-0": "held"})
    rewards(run_dir / "eval-0" / "rewards.parquet", [("held-0", "held", 0, 1.0, "ok")], ends and {})


def test_discarded_names_each_reason(tmp_path):
    iteration_run(tmp_path)
    reasons = {
        r["session_id"]: r["reason"] for r in figures.discarded(tmp_path, SessionIndex(tmp_path))["rows"]
    }
    assert reasons == {
        "flat-0": "flat group",
        "flat-1": "flat group",
        "broken-0": "timeout",
        "broken-1": "cut",
        "held-0": "held-out",
    }


def test_sessions_page_sort_filter_and_search_on_the_server(tmp_path):
    iteration_run(tmp_path)
    index = SessionIndex(tmp_path)
    first = index.page(SessionQuery(filters={}, sort="session_id", limit=2))
    assert first["total"] == 7 and [r["session_id"] for r in first["rows"]] == ["broken-0", "broken-1"]
    assert first["facets"]["stage"] == ["eval-0", "iter-0"]
    by_reward = index.page(SessionQuery(filters={"stage": "iter-0"}, sort="reward", descending=True))
    assert [r["reward"] for r in by_reward["rows"]][:3] == [1.0, 1.0, 1.0] and by_reward["total"] == 6
    assert [r["session_id"] for r in index.page(SessionQuery(filters={}, text="BUG IN mixed-1"))["rows"]] == [
        "mixed-1"
    ]
    assert index.page(SessionQuery(filters={"status": "cut"}))["rows"][0]["weight_versions"] == "0,1"


def test_the_session_table_follows_new_records(tmp_path):
    iteration_run(tmp_path)
    index = SessionIndex(tmp_path)
    assert len(index.table()) == 7
    write_records(tmp_path / "iter-1" / "flows", {"late-0": "late"})
    rows = {r["session_id"]: r for r in index.table().to_pylist()}
    assert rows["late-0"]["status"] == "running" and rows["late-0"]["calls"] == 2


def test_discarded_and_sessions_show_how_a_session_ended_where_the_rewards_say(tmp_path):
    iteration_run(tmp_path / "before")
    assert {r["end"] for r in SessionIndex(tmp_path / "before").table().to_pylist()} == {None}
    iteration_run(tmp_path, {"broken-0": "harness_timeout", "broken-1": "unparsed_tool_call"})
    index = SessionIndex(tmp_path)
    found = figures.discarded(tmp_path, index)
    rows = {r["session_id"]: r for r in found["rows"]}
    assert rows["broken-1"]["reason"] == "unparsed_tool_call" and rows["broken-1"]["detail"].startswith("cut")
    assert rows["broken-0"]["reason"] == "harness_timeout" and rows["broken-0"]["end"] == "harness_timeout"
    assert rows["flat-0"]["reason"] == "flat group" and rows["flat-0"]["end"] == "completed"
    assert found["ends"] == [
        {"stage": "iter-0", "ends": {"completed": 4, "harness_timeout": 1, "unparsed_tool_call": 1}},
        {"stage": "eval-0", "ends": {"completed": 1}},
    ]
    page = index.page(SessionQuery(filters={"end": "unparsed_tool_call"}))
    assert [r["session_id"] for r in page["rows"]] == ["broken-1"]
    assert "unparsed_tool_call" in page["facets"]["end"]


def test_a_judgment_shows_in_the_table_and_on_the_session_page(tmp_path):
    iteration_run(tmp_path)
    judgments = tmp_path / "iter-0" / JUDGMENTS_DIR
    judged = Judgment(
        "mixed-1", "mixed", 1, "rubric", "judged", 0.0, 0.75, 7.5, 0.375, "edits the <b>right</b> file"
    )
    write_judgment(judgments, judged)
    (judgments / "calls").mkdir()
    (judgments / "calls" / "k.json").write_text(json.dumps({"answer": "SCORE: 7.5"}))
    write_judgment(
        judgments, Judgment(**{**judged.__dict__, "session_id": "mixed-0", "call": "calls/k.json"})
    )
    write_summary(judgments, {"judged": 2})
    index = SessionIndex(tmp_path)
    row = index.find("mixed-1")
    assert (row["judge_score"], row["judge_mode"], row["outcome"]) == (0.75, "rubric", 0.0)
    assert index.find("flat-0")["judge_mode"] is None
    view = calls.session_view(stage_named(tmp_path, "iter-0"), row)["judgment"]
    assert (
        view["rationale"] == "edits the <b>right</b> file"
        and view["reward"] == 0.375
        and view["answer"] is None
    )
    assert calls.session_view(stage_named(tmp_path, "iter-0"), index.find("mixed-0"))["judgment"][
        "answer"
    ] == ("SCORE: 7.5")
    assert calls.session_view(stage_named(tmp_path, "iter-0"), index.find("flat-0"))["judgment"] is None


def training_files(run_dir: Path, push_every_steps: int, max_staleness: int | None) -> list[dict]:
    """run.json's GRPO settings, and iter-0's training: three steps' metrics lines (then the closing summary) and
    the loop's push stage."""
    config = {"grpo": {"push_every_steps": push_every_steps, "max_staleness": max_staleness}}
    (run_dir / "run.json").write_text(json.dumps({"config": config}))
    t0 = T0.timestamp()
    lines = [
        {"step": step, "time": t0 + 100 + step, "staleness/masked_tokens": masked, "batch/loss_tokens": 10.0}
        for step, masked in ((1, 0.0), (2, 4.0), (3, 6.0))
    ]
    lines.append({"step": 3, "time": t0 + 104, "train_runtime": 4.0})
    (run_dir / "iter-0" / "train").mkdir(parents=True)
    (run_dir / "iter-0" / "train" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    stages_done = {
        "train": {"time": t0 + 104, "weight_version": "8", "base_weight_version": "5"},
        "push": {"time": t0 + 105, "weight_version": "8"},
    }
    (run_dir / "iter-0" / "state.json").write_text(json.dumps({"iteration": 0, "stages": stages_done}))
    return lines


def test_discarded_counts_the_tokens_masked_for_staleness_per_iteration(tmp_path):
    iteration_run(tmp_path)
    training_files(tmp_path, 0, 1)
    found = figures.discarded(tmp_path, SessionIndex(tmp_path))["staleness"]
    assert found["max_staleness"] == 1
    [masked] = found["iterations"]
    assert (masked["stage"], masked["steps"], masked["steps_masking"]) == ("iter-0", 3, 2)
    assert masked["masked_tokens"] == 10.0 and masked["trained_tokens"] == 30.0


def test_engines_mark_the_pushes_of_the_iteration_end_the_training_steps_and_in_flight(tmp_path):
    spans = [{"start": 0, "version": "1"}, {"start": 1, "version": "2"}]  # v2 came at the 2nd of 2 tokens
    write_records(tmp_path / "iter-0" / "flows", {"s-0": "t", "s-1": "t"}, spans=spans)
    training_files(tmp_path, 2, None)
    pushes = timeline.engines(tmp_path)["pushes"]
    by_source = {}
    for push in pushes:
        by_source.setdefault(push["source"], []).append(push)
    assert [(p["weight_version"], p["time"] - T0.timestamp()) for p in by_source["training step"]] == [
        (("7"), 102)
    ]
    assert [p["weight_version"] for p in by_source["iteration end"]] == ["8"]
    [in_flight] = by_source["in flight"]  # two calls crossed the same push: one mark
    assert in_flight["weight_version"] == "2" and "2 calls" in in_flight["detail"]
    call_start = min(c["start"] for c in timeline.engines(tmp_path)["engines"][0]["calls"] if c["seq"] == 1)
    assert in_flight["time"] > call_start
    assert [p["time"] for p in pushes] == sorted(p["time"] for p in pushes)
    assert SessionIndex(tmp_path).find("s-0")["weight_versions"] == "0,1,2"  # the span's version counts too
