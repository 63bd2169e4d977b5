"""The dashboard's queries on small hand-made run directories (no browser, no loop): a rollout service's `--out`
folder and a `loop --service` iteration show their sessions and tasks; Discarded names each session's reason (its
status, a flat group, held-out); the session table pages, sorts, filters and searches on the server and is rebuilt
when a stage's records change."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from polar_mitm.dashboard import figures
from polar_mitm.dashboard.run_files import stages
from polar_mitm.dashboard.sessions import SessionIndex, SessionQuery
from polar_mitm.storage import service_layout
from polar_mitm.storage.journal import RecordWriter
from polar_mitm.storage.records import Record
from polar_mitm.storage.rewards import RewardRow, rewards_table, write_rewards_table

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def write_records(flows: Path, sessions: dict[str, str], prompt: str = "fix the bug") -> None:
    """Two calls per session (session id → task id), through the gateway's own writer."""
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


def iteration_run(run_dir: Path) -> None:
    sessions = {f"{task}-{i}": task for task in ("flat", "mixed", "broken") for i in range(2)}
    write_records(run_dir / "iter-0" / "flows", sessions)
    rewards = [
        RewardRow("flat-0", "flat", 0, 1.0, "ok", 0, 0.1, 1.0, 0.1, ""),
        RewardRow("flat-1", "flat", 1, 1.0, "ok", 0, 0.1, 1.0, 0.1, ""),
        RewardRow("mixed-0", "mixed", 0, 1.0, "ok", 0, 0.1, 1.0, 0.1, ""),
        RewardRow("mixed-1", "mixed", 1, 0.0, "failed", 0, 0.1, 1.0, 0.1, ""),
        RewardRow("broken-0", "broken", 0, None, "timeout", None, 0.1, 120.0, None, ""),
        RewardRow("broken-1", "broken", 1, None, "cut", None, 0.1, 3.0, None, ""),
    ]
    write_rewards_table(rewards_table(rewards), run_dir / "iter-0" / "rewards.parquet")
    write_records(run_dir / "eval-0" / "flows", {"held-0": "held"})
    write_rewards_table(
        rewards_table([RewardRow("held-0", "held", 0, 1.0, "ok", 0, 0.1, 1.0, 0.1, "")]),
        run_dir / "eval-0" / "rewards.parquet",
    )


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
