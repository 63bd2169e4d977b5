"""Held-out evaluation and experiment logs of `polar-mitm loop` (issue 26 items 2 and 3).

The estimator is checked against the definition it estimates (the chance that k attempts drawn without replacement
from the n made hold a passing one). One 2-iteration loop on the CPU demo tasks — two trained, the third held out —
is shared by the end-to-end checks: the held-out sessions reach no training shard, loop.json's pass@k is the
estimator's on the recorded rewards, and TensorBoard's own reader finds the loop's reward and the trainer's loss for
both iterations in one run.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.loop.evaluation import check_held_out, eval_due, pass_at_k, reported_ks
from polar_mitm.loop.trackers import TENSORBOARD_DIR, TrackerUnavailable, check_tracker
from polar_mitm.storage.records import read_all
from polar_mitm.tasks.task_file import load_tasks
from tests.loop.evaluated_loop import EVAL_SAMPLES, EXAMPLES, HELD_OUT, ITERATIONS, evaluated_loop_run


def pass_at_k_by_enumeration(samples: int, correct: int, k: int) -> float:
    """The fraction of all k-subsets of the attempts that hold at least one pass (what pass@k estimates)."""
    outcomes = [True] * correct + [False] * (samples - correct)
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("samples", [1, 2, 5, 8])
def test_pass_at_k_equals_the_codex_estimator_on_known_counts(samples):
    for correct in range(samples + 1):
        for k in range(1, samples + 1):
            expected = pass_at_k_by_enumeration(samples, correct, k)
            assert pass_at_k(samples, correct, k) == pytest.approx(expected, abs=1e-12)
    # pass@1 is the pass rate
    assert pass_at_k(samples, samples // 2, 1) == pytest.approx((samples // 2) / samples)


def test_pass_at_k_refuses_impossible_counts():
    for samples, correct, k in [(4, 5, 1), (4, 2, 5), (4, 2, 0), (3, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(samples, correct, k)


def test_reported_ks_and_eval_schedule():
    assert reported_ks(1) == [1]
    assert reported_ks(6) == [1, 2, 4, 6]
    assert reported_ks(8) == [1, 2, 4, 8]
    assert [k for k in range(7) if eval_due(k, 3, 7)] == [2, 5, 6]  # every 3rd and the last


def test_eval_tasks_sharing_a_task_id_with_training_are_refused():
    tasks = load_tasks(EXAMPLES / "tasks.jsonl")
    with pytest.raises(ValueError, match="hello-file"):
        check_held_out(tasks, [t for t in tasks if t.task_id == "hello-file"])
    check_held_out(tasks[:2], tasks[2:])


def test_unavailable_tracker_is_refused_in_one_line():
    for name in ("tensorboard", "mlflow", "wandb", "none"):
        check_tracker(name)
    with pytest.raises(TrackerUnavailable, match="neptune"):
        check_tracker("neptune")


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory) -> Path:
    # one run for the session, shared with the tracker and report tests
    return evaluated_loop_run(tmp_path_factory)


def session_ids(table: Path) -> set[str]:
    """The session ids of a Parquet file, or of every shard under a directory."""
    shards = [table] if table.is_file() else sorted(table.rglob("*.parquet"))
    return {
        sid
        for shard in shards
        for sid in pq.read_table(shard, columns=["session_id"]).column("session_id").to_pylist()
    }


@pytest.mark.slow
def test_held_out_sessions_never_reach_a_training_shard(evaluated_run):
    trained = set().union(*(session_ids(evaluated_run / f"iter-{k}" / "merged") for k in range(ITERATIONS)))
    assert trained  # the training shards exist and hold sessions
    for k in range(ITERATIONS):
        evaluated = session_ids(evaluated_run / f"eval-{k}" / "rewards.parquet")
        assert len(evaluated) == EVAL_SAMPLES and all(s.startswith(HELD_OUT) for s in evaluated)
        recorded = {row["session_id"] for row in read_all(evaluated_run / f"eval-{k}" / "flows").to_pylist()}
        assert recorded == evaluated  # the evaluation really ran through its own gateway
        assert not evaluated & trained
    assert not any(s.startswith(HELD_OUT) for s in trained)


@pytest.mark.slow
def test_loop_json_reports_the_estimators_pass_at_k_of_the_recorded_rewards(evaluated_run):
    iterations = json.loads((evaluated_run / "loop.json").read_text())
    assert [it["eval"]["iteration"] for it in iterations] == list(range(ITERATIONS))
    for it in iterations:
        rewards = pq.read_table(evaluated_run / f"eval-{it['iteration']}" / "rewards.parquet").to_pylist()
        passed = sum(r["reward"] > 0 for r in rewards)
        assert it["eval"]["per_task"] == {HELD_OUT: {"samples": EVAL_SAMPLES, "passed": passed}}
        assert it["eval"]["weight_version"] == it["weight_version"]  # the weights that iteration pushed
        assert set(it["eval"]["pass_at"]) == {"pass@1", f"pass@{EVAL_SAMPLES}"}
        for k in (1, EVAL_SAMPLES):
            expected = pass_at_k_by_enumeration(EVAL_SAMPLES, passed, k)
            assert it["eval"]["pass_at"][f"pass@{k}"] == pytest.approx(expected)


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the run's TensorBoard events, read back with TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: {event.step: event.value for event in accumulator.Scalars(tag)}
        for tag in accumulator.Tags()["scalars"]
    }


@pytest.mark.slow
def test_tensorboard_holds_loop_reward_and_trainer_loss_for_both_iterations(evaluated_run):
    assert len(list((evaluated_run / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 1  # one tracked run
    logged = scalars(evaluated_run)
    iterations = json.loads((evaluated_run / "loop.json").read_text())
    assert logged["loop/reward_mean"] == pytest.approx(
        {it["iteration"]: it["reward_mean"] for it in iterations}
    )
    assert logged["eval/pass@1"] == pytest.approx(
        {it["iteration"]: it["eval"]["pass_at"]["pass@1"] for it in iterations}
    )
    losses: dict[int, float] = {}
    for k in range(ITERATIONS):
        rows = (evaluated_run / f"iter-{k}" / "train" / "metrics.jsonl").read_text().splitlines()
        steps = {r["run_step"]: r["loss"] for r in map(json.loads, rows) if "loss" in r}
        assert steps, f"iteration {k} logged no loss"
        assert not steps.keys() & losses.keys()  # run-wide steps: the second training continues the first
        losses.update(steps)
    assert logged["train/loss"] == pytest.approx(losses)


@pytest.mark.slow
def test_report_draws_the_held_out_curve_beside_the_training_reward(evaluated_run):
    from polar_mitm.report.charts import build_charts, held_out_points
    from polar_mitm.report.collect import collect_run

    run = collect_run(evaluated_run)
    iterations = json.loads((evaluated_run / "loop.json").read_text())
    assert held_out_points(run) == [(it["iteration"], it["eval"]["pass_at"]["pass@1"]) for it in iterations]
    reward = next(chart for chart in build_charts(run) if chart.chart_id == "reward")
    assert "held-out pass@1" in reward.title and "held-out pass@1" in reward.svg
