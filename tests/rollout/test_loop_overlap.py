"""`polar-mitm loop --overlap N` (issue 26 item 5): rollouts up to N iterations ahead of the trainer, every trained
call's staleness reported, and a push that lands while sessions are mid-flight.

One real 3-iteration loop with `--overlap 2` on the tiny model and the scripted policy (one optimizer step per
training, so weight versions count trainings). A trainer callback holds the first training until the third rollout
has begun — the most the overlap allows: rollouts 0, 1 and 2 all sample the initial weights — and holds its end
(the push comes right after) until a session of that rollout has made a call and not finished, so that session's
calls straddle the push. Then: the trained calls are 0, 1 and 2 versions stale in iterations 0, 1, 2 (the loop's
per-call counts and the trainer's own staleness metric agree), and the straddling session's calls count 2 and 1.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import TrainerCallback

from polar_mitm.rollout.loop import Loop, LoopConfig
from polar_mitm.rollout.run_state import read_lines
from polar_mitm.storage.records import read_all

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"
ITERATIONS, OVERLAP = 3, 2
DEADLINE_S = 300


def session_versions(it: Path) -> dict[str, list[str]]:
    """Each recorded session of an iteration → its calls' weight versions, in call order."""
    rows = read_all(it / "flows").select(["session_id", "seq", "weight_version"]).to_pylist()
    calls: dict[str, list[tuple[int, str]]] = {}
    for row in rows:
        calls.setdefault(row["session_id"], []).append((row["seq"], row["weight_version"]))
    return {sid: [v for _, v in sorted(seq)] for sid, seq in calls.items()}


class HoldFirstTraining(TrainerCallback):
    """Holds the run's first training until rollout `ITERATIONS - 1` has begun, and its end (the push follows)
    until a session of that rollout is between calls."""

    def __init__(self, run_dir: Path) -> None:
        self.last = run_dir / f"iter-{ITERATIONS - 1}"
        self.trainings = 0
        self.straddler: str | None = None
        self.tick = threading.Event()  # never set: its wait is the poll interval

    def _until(self, condition) -> None:
        for _ in range(DEADLINE_S * 20):
            if condition():
                return
            self.tick.wait(0.05)
        raise AssertionError(f"{self.last} never reached the state the test waits for")

    def _rollout_done(self) -> bool:
        state = self.last / "state.json"
        return state.exists() and "rollout" in json.loads(state.read_text())["stages"]

    def _in_flight(self) -> bool:
        if self._rollout_done():
            return True  # too late: no session left to straddle (the assertions say so)
        finished = {r["session_id"] for r in read_lines(self.last / "sessions.jsonl")}
        started = set(session_versions(self.last)) if (self.last / "flows").exists() else set()
        waiting = sorted(started - finished)
        self.straddler = waiting[0] if waiting else None
        return bool(waiting)

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainings += 1
        if self.trainings == 1:
            self._until(lambda: (self.last / "flows").exists() and bool(session_versions(self.last)))

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainings == 1:
            self._until(self._in_flight)


@pytest.fixture(scope="module")
def overlapped_run(tmp_path_factory) -> tuple[Path, HoldFirstTraining]:
    base = tmp_path_factory.mktemp("loop-overlap")
    rows = [json.loads(line) for line in (EXAMPLES / "tasks.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        row["workspace"]["dir"] = str((EXAMPLES / row["workspace"]["dir"]).resolve())
    tasks = base / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    cfg = LoopConfig(
        tasks=tasks,
        run_dir=base / "run",
        iterations=ITERATIONS,
        group_size=2,
        concurrency=2,
        model="tiny",
        script=EXAMPLES / "policy.json",
        learning_rate=1e-2,
        max_tokens=64,
        overlap=OVERLAP,
    )
    hold = HoldFirstTraining(cfg.run_dir)
    Loop(cfg, trainer_callbacks=[hold]).run()
    return cfg.run_dir, hold


@pytest.mark.slow
def test_overlap_2_trains_calls_up_to_two_versions_stale(overlapped_run):
    run_dir, _ = overlapped_run
    loop = json.loads((run_dir / "loop.json").read_text())
    assert [row["weight_version"] for row in loop] == ["1", "2", "3"]  # one step per training
    # Rollouts 0 and 1 ran before any push: all their calls sampled the initial weights.
    for k in (0, 1):
        assert {v for vs in session_versions(run_dir / f"iter-{k}").values() for v in vs} == {"0"}
    assert set(loop[0]["call_staleness"]) == {"0"} and set(loop[1]["call_staleness"]) == {"1"}
    assert set(loop[2]["call_staleness"]) == {"1", "2"}  # before and after the first push
    for row in loop:
        trained = read_all(run_dir / f"iter-{row['iteration']}" / "flows").num_rows
        assert sum(row["call_staleness"].values()) == trained  # every call of every trained session
    # The trainer's own metric (per sequence, from its oldest call) reaches the overlap and no further.
    for k, expected in enumerate((0, 1, 2)):
        rows = read_lines(run_dir / f"iter-{k}" / "train" / "metrics.jsonl")
        assert max(r["staleness/max"] for r in rows if "staleness/max" in r) == expected


@pytest.mark.slow
def test_a_session_straddling_a_push_has_each_calls_staleness(overlapped_run):
    run_dir, hold = overlapped_run
    it = run_dir / f"iter-{ITERATIONS - 1}"
    versions = session_versions(it)
    assert hold.straddler is not None, "no session of the last rollout was between calls at the push"
    calls = versions[hold.straddler]
    assert calls[0] == "0" and calls[-1] == "1", calls  # sampled before and after the push
    base = 2  # the last training starts from weights version 2
    per_call = [base - int(v) for v in calls]
    assert set(per_call) == {2, 1}
    straddling = [sid for sid, vs in versions.items() if len(set(vs)) > 1]
    loop = json.loads((run_dir / "loop.json").read_text())
    counted = loop[-1]["call_staleness"]
    whole = [sid for sid, vs in versions.items() if len(set(vs)) == 1]
    assert counted["1"] == sum(vs.count("1") for vs in versions.values())  # straddlers' later calls included
    assert counted["2"] == sum(vs.count("0") for vs in versions.values())
    assert straddling and len(straddling) + len(whole) == len(versions)
    # The straddling session is trained, as one sequence spanning both versions.
    shards = sorted((it / "merged").rglob("*.parquet"))
    merged = [
        row
        for shard in shards
        for row in pq.read_table(
            shard, columns=["session_id", "weight_version_min", "weight_version_max"]
        ).to_pylist()
        if row["session_id"] == hold.straddler
    ]
    assert merged and {(r["weight_version_min"], r["weight_version_max"]) for r in merged} == {("0", "1")}
