"""`--report-to tensorboard|mlflow|wandb`: every tracker holds one run for the whole loop, across `--resume`, read
back with the tracker's own library — TensorBoard's EventAccumulator, MLflow's client on the local file store, and
W&B's own record protobufs in its offline run files (W&B has no reader for offline runs but its sync).

The tracker objects are driven directly for the resume semantics (seconds); the shared evaluated 2-iteration loop
(tests/loop/evaluated_loop.py, all three trackers at once) shows the loop's reward and evaluation and the
trainer's loss for both iterations in each store; and test_loop_resume's one run, killed with SIGKILL at every
stage and resumed each time, calls check_one_tracked_run_across_resumes: one tracked run per store across them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from polar_mitm.loop.trackers import (
    MLFLOW_DIR,
    PROJECT,
    TENSORBOARD_DIR,
    TRACKER_STATE,
    WANDB_DIR,
    NoTracker,
    TrackerUnavailable,
    check_tracker,
    log_training_metrics,
    mlflow_metric_name,
    offline_environment,
    open_tracker,
)
from tests.loop.evaluated_loop import ITERATIONS, evaluated_loop_run

ALL = "tensorboard,mlflow,wandb"
Scalars = dict[str, dict[int, float]]  # tag → step → value


def tensorboard_scalars(run_dir: Path) -> Scalars:
    """Every scalar of the run's TensorBoard directory (all its event files: one run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: {event.step: event.value for event in accumulator.Scalars(tag)}
        for tag in accumulator.Tags()["scalars"]
    }


def mlflow_client(run_dir: Path):
    """MLflow's own client on the run's file store (which MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE)."""
    offline_environment()
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=(run_dir / MLFLOW_DIR).resolve().as_uri())


def mlflow_runs(run_dir: Path) -> list[str]:
    """The run ids of the polar-mitm experiment in the run's MLflow file store."""

    client = mlflow_client(run_dir)
    experiment = client.get_experiment_by_name(PROJECT)
    return [run.info.run_id for run in client.search_runs([experiment.experiment_id])]


def mlflow_scalars(run_dir: Path, run_id: str, tags: list[str]) -> Scalars:
    """Each tag's points in the MLflow run, every point kept (a step logged twice would show twice)."""
    client = mlflow_client(run_dir)
    scalars: Scalars = {}
    for tag in tags:
        history = client.get_metric_history(run_id, mlflow_metric_name(tag))
        assert len({m.step for m in history}) == len(history), f"{tag}: a step logged twice"
        scalars[tag] = {m.step: m.value for m in history}
    return scalars


def wandb_records(path: Path) -> list:
    """The records of one offline `.wandb` file: W&B's LevelDB-style log (a 7-byte file header, 32 KiB blocks of
    chunks with a 7-byte header: CRC, length, type), each record one of W&B's own `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    records, payload, position = [], b"", 7
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # the rest of a block too small for a chunk header is padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            position += room
            continue
        payload += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def wandb_scalars(run_dir: Path, run_id: str) -> Scalars:
    """Each metric against its group's step metric (`steps/GROUP`), over every offline run folder of `run_id`."""
    folders = sorted((run_dir / WANDB_DIR).glob(f"offline-run-*-{run_id}*"))
    assert folders, f"no offline W&B run {run_id}"
    scalars: Scalars = {}
    for folder in folders:
        for record in wandb_records(folder / f"run-{run_id}.wandb"):
            if record.WhichOneof("record_type") == "run":
                assert record.run.run_id == run_id
            if record.WhichOneof("record_type") != "history":
                continue
            row = {
                "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                for item in record.history.item
            }
            for tag, value in row.items():
                if tag.startswith(("_", "steps/")):
                    continue
                step = int(row[f"steps/{tag.split('/', 1)[0]}"])
                assert step not in scalars.get(tag, {}), f"{tag}: step {step} logged twice"
                scalars.setdefault(tag, {})[step] = value
    return scalars


def assert_scalars(logged: Scalars, expected: Scalars) -> None:
    """`logged` holds exactly the expected points of each expected tag (float32 stores: approximately)."""
    for tag, points in expected.items():
        assert logged.get(tag) == pytest.approx(points), tag


def tracker_state(run_dir: Path) -> dict:
    return json.loads((run_dir / TRACKER_STATE).read_text())


def test_unknown_or_missing_trackers_are_refused_in_one_line():
    for good in ("tensorboard", "mlflow", "wandb", "none", ALL, "mlflow, wandb"):
        check_tracker(good)
    for bad in ("neptune", "tensorboard,comet", "", ","):
        with pytest.raises(TrackerUnavailable, match="not one of"):
            check_tracker(bad)
    assert isinstance(open_tracker("none", Path("/nonexistent")), NoTracker)  # nothing is written for none


def test_every_tracker_keeps_one_run_across_a_resume_and_each_step_once(tmp_path):
    run_dir = tmp_path / "run"
    tracker = open_tracker(ALL, run_dir)
    tracker.log({"eval/pass@1": 0.0625}, step=-1)  # --eval-start: the starting weights, before iteration 0
    for iteration, reward in enumerate((0.25, 0.5)):
        tracker.log({"loop/reward_mean": reward, "eval/pass@1": reward / 2}, step=iteration)
    tracker.log({"train/loss": 0.9}, step=1)
    tracker.close()
    first = tracker_state(run_dir)
    # A kill after iteration 1 was logged, before it was recorded: the resumed loop reports it again.
    resumed = open_tracker(ALL, run_dir, resume=True)
    resumed.log({"loop/reward_mean": 0.4, "eval/pass@1": 0.2}, step=1)  # already there: not logged again
    resumed.log({"loop/reward_mean": 0.75, "eval/pass@1": 0.375}, step=2)
    resumed.log({"train/loss": 0.7}, step=2)
    resumed.close()
    state = tracker_state(run_dir)
    assert (state["mlflow_run_id"], state["wandb_run_id"]) == (first["mlflow_run_id"], first["wandb_run_id"])
    expected = {
        "loop/reward_mean": {0: 0.25, 1: 0.5, 2: 0.75},
        "eval/pass@1": {-1: 0.0625, 0: 0.125, 1: 0.25, 2: 0.375},
        "train/loss": {1: 0.9, 2: 0.7},
    }
    assert_scalars(tensorboard_scalars(run_dir), expected)
    assert mlflow_runs(run_dir) == [state["mlflow_run_id"]]  # one tracked run, not one per start
    assert_scalars(mlflow_scalars(run_dir, state["mlflow_run_id"], list(expected)), expected)
    assert len(list((run_dir / WANDB_DIR).glob("offline-run-*"))) == 2  # one folder per process start, one id
    assert_scalars(wandb_scalars(run_dir, state["wandb_run_id"]), expected)
    # Without resume, the same directory gets new tracked runs.
    open_tracker("mlflow,wandb", run_dir).close()
    fresh = tracker_state(run_dir)
    assert fresh["mlflow_run_id"] != state["mlflow_run_id"] and fresh["wandb_run_id"] != state["wandb_run_id"]
    assert len(mlflow_runs(run_dir)) == 2


def test_training_metrics_are_forwarded_at_their_run_wide_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "run_step": 5, "loss": 0.3, "clip_ratio": {"low_mean": 0.0}, "epoch": 1.0}]
    rows.append({"step": 2, "run_step": 6, "loss": 0.2, "train_runtime": 3.5})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tracker = open_tracker("mlflow", tmp_path / "run")
    assert log_training_metrics(tracker, metrics) == 2
    tracker.close()
    run_id = tracker_state(tmp_path / "run")["mlflow_run_id"]
    logged = mlflow_scalars(
        tmp_path / "run", run_id, ["train/loss", "train/clip_ratio/low_mean", "train/epoch"]
    )
    assert logged == {
        "train/loss": {5: 0.3, 6: 0.2},
        "train/clip_ratio/low_mean": {5: 0.0},
        "train/epoch": {},
    }


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory) -> Path:
    return evaluated_loop_run(tmp_path_factory)


def loop_expected(run_dir: Path) -> Scalars:
    """What loop.json and the trainings' metrics.jsonl say each store must hold."""
    iterations = json.loads((run_dir / "loop.json").read_text())
    losses: dict[int, float] = {}
    for k in range(ITERATIONS):
        rows = (run_dir / f"iter-{k}" / "train" / "metrics.jsonl").read_text().splitlines()
        steps = {r["run_step"]: r["loss"] for r in map(json.loads, rows) if "loss" in r}
        assert steps, f"iteration {k} logged no loss"
        assert not steps.keys() & losses.keys()  # run-wide steps: the second training continues the first
        losses.update(steps)
    return {
        "loop/reward_mean": {it["iteration"]: it["reward_mean"] for it in iterations},
        "eval/pass@1": {it["iteration"]: it["eval"]["pass_at"]["pass@1"] for it in iterations},
        "train/loss": losses,
    }


@pytest.mark.slow
@pytest.mark.parametrize("store", ["tensorboard", "mlflow", "wandb"])
def test_loop_reward_eval_and_trainer_loss_of_both_iterations_in_each_store(loop_run, store):
    expected = loop_expected(loop_run)
    assert sorted(expected["loop/reward_mean"]) == list(range(ITERATIONS))
    state = tracker_state(loop_run)
    if store == "tensorboard":
        assert len(list((loop_run / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 1  # one tracked run
        logged = tensorboard_scalars(loop_run)
    elif store == "mlflow":
        assert mlflow_runs(loop_run) == [state["mlflow_run_id"]]
        logged = mlflow_scalars(loop_run, state["mlflow_run_id"], list(expected))
    else:
        logged = wandb_scalars(loop_run, state["wandb_run_id"])
    assert_scalars(logged, expected)


def check_one_tracked_run_across_resumes(run_dir: Path, starts: int, first: dict) -> None:
    """A `polar-mitm loop --report-to tensorboard,mlflow,wandb` started `starts` times (killed with SIGKILL, then
    `--resume`d, each time): the run ids `first` (trackers.json at the first kill) kept, each store holds one run
    with both iterations' reward and every training step's loss once. Called by test_loop_resume's killed run."""
    state = tracker_state(run_dir)
    assert (state["mlflow_run_id"], state["wandb_run_id"]) == (first["mlflow_run_id"], first["wandb_run_id"])
    iterations = json.loads((run_dir / "loop.json").read_text())
    losses = {
        row["run_step"]: row["loss"]
        for k in range(2)
        for row in map(
            json.loads, (run_dir / f"iter-{k}" / "train" / "metrics.jsonl").read_text().splitlines()
        )
        if "loss" in row
    }
    expected = {
        "loop/reward_mean": {it["iteration"]: it["reward_mean"] for it in iterations},
        "train/loss": losses,
    }
    assert sorted(expected["loop/reward_mean"]) == [0, 1] and losses
    events = list((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert len(events) == starts  # one run, one writer per start
    assert_scalars(tensorboard_scalars(run_dir), expected)
    assert mlflow_runs(run_dir) == [state["mlflow_run_id"]]
    assert_scalars(mlflow_scalars(run_dir, state["mlflow_run_id"], list(expected)), expected)
    assert len(list((run_dir / WANDB_DIR).glob(f"offline-run-*-{state['wandb_run_id']}*"))) == starts
    assert_scalars(wandb_scalars(run_dir, state["wandb_run_id"]), expected)
