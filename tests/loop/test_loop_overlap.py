"""`polar-mitm loop --overlap N` (issue 26 item 5): rollouts up to N iterations ahead of the trainer, every trained
call's staleness reported, and a push that lands while sessions are mid-flight.

One real 3-iteration loop with `--overlap 2` on the tiny model and a scripted policy (one optimizer step per
training, so weight versions count trainings). A trainer callback holds the first training until the third rollout
is under way — the most the overlap allows: rollouts 0, 1 and 2 all start on the initial weights. The first task's
tool call waits, in that third rollout only, for a gate file that the test opens once the first push is done
(the loop's `on_iteration`), so those sessions make their first call before the push and their second after it.
Then: the trained calls are 0, 1 and 2 versions stale in iterations 0, 1, 2 (the loop's per-call counts and the
trainer's own staleness metric agree), and each straddling session's calls count 2 and 1.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import TrainerCallback

from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.loop import Loop
from polar_mitm.storage.records import read_all

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"
ITERATIONS, OVERLAP, GROUP = 3, 2, 2
GATED = "gated-hello"  # the task whose sessions straddle the first push
DEADLINE_S = 300


def session_versions(it: Path) -> dict[str, list[str]]:
    """Each recorded session of an iteration → its calls' weight versions, in call order."""
    if not (it / "flows").exists():
        return {}
    rows = read_all(it / "flows").select(["session_id", "seq", "weight_version"]).to_pylist()
    calls: dict[str, list[tuple[int, str]]] = {}
    for row in rows:
        calls.setdefault(row["session_id"], []).append((row["seq"], row["weight_version"]))
    return {sid: [v for _, v in sorted(seq)] for sid, seq in calls.items()}


def write_inputs(base: Path) -> tuple[Path, Path, Path, Path]:
    """Task file (the gated task first, then the demo's typo task) and a policy whose gated tool call, once `armed`
    exists, waits for `pushed` before writing the file."""
    armed, pushed = base / "armed", base / "pushed"
    wait = f"if [ -f {armed} ]; then while [ ! -f {pushed} ]; do sleep 0.1; done; fi"
    policy = json.loads((EXAMPLES / "policy.json").read_text())
    policy["replies"].insert(
        0,
        {
            "when": "Wait for the gate",
            "turn": 0,
            "choices": [
                {
                    "text": "Waiting.",
                    "tool_call": {"name": "shell", "arguments": {"command": f"{wait}; echo {w} > out.txt"}},
                }
                for w in ("hello", "Hello")
            ],
        },
    )
    rows = [json.loads(line) for line in (EXAMPLES / "tasks.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        row["workspace"]["dir"] = str((EXAMPLES / row["workspace"]["dir"]).resolve())
    gated = {**rows[0], "task_id": GATED, "prompt": "Wait for the gate, then create out.txt holding: hello"}
    tasks = base / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in [gated, rows[1]]))
    (base / "policy.json").write_text(json.dumps(policy))
    return tasks, base / "policy.json", armed, pushed


class HoldFirstTraining(TrainerCallback):
    """Holds the run's first training until rollout 1 is done (then arms the gate) and both gated sessions of
    rollout 2 have made their first call (they run side by side: -c 2, and the gated task comes first)."""

    def __init__(self, run_dir: Path, armed: Path) -> None:
        self.run_dir, self.armed = run_dir, armed
        self.trainings = 0
        self.tick = threading.Event()  # never set: its wait is the poll interval

    def _until(self, condition) -> None:
        for _ in range(DEADLINE_S * 20):
            if condition():
                return
            self.tick.wait(0.05)
        raise AssertionError("the run never reached the state the test waits for")

    def _rollout_done(self, k: int) -> bool:
        state = self.run_dir / f"iter-{k}" / "state.json"
        return state.exists() and "rollout" in json.loads(state.read_text())["stages"]

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainings += 1
        if self.trainings == 1:
            self._until(lambda: self._rollout_done(1))
            self.armed.touch()
            last = self.run_dir / f"iter-{ITERATIONS - 1}"
            # Both gated sessions, not just one: the training and push take seconds on the tiny model, so a gated
            # session still starting its harness would otherwise make its first call after the push.
            self._until(lambda: sum(sid.startswith(GATED) for sid in session_versions(last)) == GROUP)


@pytest.fixture(scope="module")
def overlapped_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("loop-overlap")
    tasks, policy, armed, pushed = write_inputs(base)
    cfg = LoopConfig(
        tasks=tasks,
        run_dir=base / "run",
        iterations=ITERATIONS,
        group_size=GROUP,
        concurrency=2,
        model="tiny",
        script=policy,
        learning_rate=1e-2,
        max_tokens=256,  # the gated tool call, with its two paths, is long
        overlap=OVERLAP,
        # Every iteration trains (one step each), flat or not: the weight versions count iterations.
        grpo={"keep_zero_advantage_groups": True},
        sandbox="none",  # the gated tool call waits for files this test writes beside the workspaces
    )

    def after(stats) -> None:
        if stats.iteration == 0:
            pushed.touch()  # the first push is done: the gated sessions make their second call

    Loop(cfg, on_iteration=after, trainer_callbacks=[HoldFirstTraining(cfg.run_dir, armed)]).run()
    return cfg.run_dir


@pytest.mark.slow
def test_overlap_2_trains_calls_up_to_two_versions_stale(overlapped_run):
    loop = json.loads((overlapped_run / "loop.json").read_text())
    assert [row["weight_version"] for row in loop] == ["1", "2", "3"]  # one step per training
    # Rollouts 0 and 1 ran before any push: all their calls sampled the initial weights.
    for k in (0, 1):
        assert {v for vs in session_versions(overlapped_run / f"iter-{k}").values() for v in vs} == {"0"}
    assert set(loop[0]["call_staleness"]) == {"0"} and set(loop[1]["call_staleness"]) == {"1"}
    # The gated sessions' first calls sampled version 0 (staleness 2); later calls sample whatever was pushed by
    # then — version 1, or 2 once the second training (fast on the tiny model) has pushed — never further back.
    assert "2" in loop[2]["call_staleness"] and set(loop[2]["call_staleness"]) <= {"0", "1", "2"}
    for row in loop:
        calls = read_all(overlapped_run / f"iter-{row['iteration']}" / "flows").num_rows
        assert sum(row["call_staleness"].values()) == calls  # every call of every trained session
        # and every trained token, once, by the version of its span
        assert sum(row["token_staleness"].values()) == row["trainable_tokens"]
        # each push's cost to the sessions running under it: the embedded engine swaps between two tokens
        assert row["train_skipped"] or (row["push"]["mode"] == "swap" and row["push"]["pause_seconds"] >= 0)
    assert set(loop[1]["token_staleness"]) == {"1"}
    # The trainer's own metric (per sequence, from its oldest call) reaches the overlap and no further; in the
    # last iteration only the gated sessions started on version 0, so 2 is reached when their group is trained.
    for k, expected in enumerate((0, 1, 2)):
        path = overlapped_run / f"iter-{k}" / "train" / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert max(r["staleness/max"] for r in rows if "staleness/max" in r) == expected


@pytest.mark.slow
def test_sessions_straddling_a_push_count_each_calls_staleness(overlapped_run):
    it = overlapped_run / f"iter-{ITERATIONS - 1}"
    versions = session_versions(it)
    straddling = {sid: calls for sid, calls in versions.items() if sid.startswith(GATED)}
    assert len(straddling) == 2
    for calls in straddling.values():
        assert calls == ["0", "1"]  # sampled before the push, and after it
    # The last training starts from version 2: each call counts by its own version (2 and 1 for a straddler).
    counted = json.loads((overlapped_run / "loop.json").read_text())[-1]["call_staleness"]
    assert counted["2"] == sum(calls.count("0") for calls in versions.values()) == 2
    assert counted["1"] == sum(calls.count("1") for calls in versions.values())
    # Each straddling session is trained, as one sequence spanning both versions.
    shards = sorted((it / "merged").rglob("*.parquet"))
    columns = ["session_id", "weight_version_min", "weight_version_max"]
    merged = [row for shard in shards for row in pq.read_table(shard, columns=columns).to_pylist()]
    spans = {
        (r["weight_version_min"], r["weight_version_max"]) for r in merged if r["session_id"] in straddling
    }
    assert {r["session_id"] for r in merged} >= set(straddling) and spans == {("0", "1")}
