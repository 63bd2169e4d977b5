"""Experiment trackers for `polar-mitm loop --report-to`: the loop's per-iteration figures, its held-out
evaluations and the trainer's per-step metrics go to one tracked run for the whole loop — across iterations and
across `--resume` — so a long run shows up where a team already watches runs.

Each iteration's training keeps `report_to=[]` (transformers would open a new tracked run per training, with its
step count restarting); the loop instead forwards that training's `metrics.jsonl` rows (written by the in-process
trainer and by `--train-processes` launches alike) at their run-wide optimizer step `run_step`.

Nothing here may reach a network, whatever the environment says: TensorBoard writes event files (torch's
`SummaryWriter`) under RUN/tensorboard; MLflow writes a local file store under RUN/mlruns through a client bound to
that `file:` URI, with its usage telemetry off; W&B runs in offline mode under RUN/wandb (`wandb sync` uploads it
later). `--report-to` takes one name or a comma list (`tensorboard,mlflow`): every tracker gets the same points.

One tracked run per loop run: the MLflow run id and the W&B run id are kept in RUN/trackers.json with the last step
logged per metric, so `open_tracker(..., resume=True)` continues the same run and a step logged before a crash is
not logged twice (the first value of a (metric, step) stays, in every tracker alike). W&B is the exception: its
points reach disk through a writer process of its own, some time after `run.log` returns, so a kill can lose points
trackers.json already counts; a resumed W&B run goes on from what its own offline files hold (`wandb_logged_steps`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

TRACKERS: tuple[str, ...] = ("tensorboard", "mlflow", "wandb", "none")
TENSORBOARD_DIR = "tensorboard"  # under the run directory
MLFLOW_DIR = "mlruns"  # the MLflow file store, under the run directory
WANDB_DIR = "wandb"  # W&B's offline runs (wandb.init(dir=RUN) writes RUN/wandb/offline-run-*)
TRACKER_STATE = "trackers.json"  # under the run directory: run ids and the last step logged per metric
PROJECT = "polar-mitm"  # the MLflow experiment and the W&B project
# the package each tracker needs, for a one-line refusal before the engine starts
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
# metrics.jsonl keys that are bookkeeping, not metrics
NOT_METRICS = frozenset({"step", "run_step", "epoch", "time"})
# characters MLflow accepts in a metric name (anything else, e.g. the "@" of pass@k, is spelled out or replaced)
MLFLOW_NAME_CHARS = re.compile(r"[^\w\-. :/]")


class TrackerUnavailable(RuntimeError):
    """The chosen tracker cannot be used here (unknown, or its package is missing)."""


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NoTracker:
    """`--report-to none`: loop.json and metrics.jsonl only."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """One TensorBoard run (event files under `log_dir`) for the whole loop; a resumed run adds an events file to
    the same directory, which TensorBoard reads as the same run."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # a long run's curves show up as they are made

    def close(self) -> None:
        self.writer.close()


def mlflow_metric_name(tag: str) -> str:
    """`eval/pass@2` → `eval/pass_at_2`: MLflow refuses names outside alphanumerics, `_-. :/`."""
    return MLFLOW_NAME_CHARS.sub("_", tag.replace("@", "_at_"))


def offline_environment_values() -> dict[str, str]:
    """What keeps MLflow and W&B off the network (`offline_environment`)."""
    return {
        "MLFLOW_DISABLE_TELEMETRY": "true",  # read when mlflow is imported
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 keeps the file store behind this switch
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }


def offline_environment() -> None:
    """What keeps MLflow and W&B off the network in this process (and its children), set by us, not the user."""
    os.environ.update(offline_environment_values())


WANDB_SERVICE_ENV = "WANDB_SERVICE"  # where wandb leaves its service's address for child processes to share


def own_wandb_service() -> None:
    """Drop a W&B service inherited from a parent process, so this process starts its own, which dies with it.

    wandb puts its service's address (`VERSION-PID-…`, PID the process that started it) in the environment, and a
    child process connects to that service instead of starting one. A loop launched from a process that used W&B
    (a notebook, a test session) would then register its run in the parent's long-lived service; after a SIGKILL of
    the loop that service keeps the run id "in use", and no `--resume` can open the run again."""
    token = os.environ.get(WANDB_SERVICE_ENV, "")
    parts = token.split("-")
    if token and not (len(parts) > 1 and parts[1] == str(os.getpid())):
        del os.environ[WANDB_SERVICE_ENV]


class MlflowTracker:
    """One MLflow run in the local file store `RUN/mlruns` (browse it with `mlflow ui --backend-store-uri`)."""

    def __init__(self, store: Path, run_id: str | None, run_name: str) -> None:
        offline_environment()
        from mlflow import MlflowClient

        if not store.exists():
            from mlflow.store.tracking.file_store import FileStore

            # lays the store out: MLflow caches a store per URI, which would not notice a folder removed since (a
            # run directory wiped and reused in this process)
            FileStore(str(store))
        self.store_uri = store.resolve().as_uri()  # file:///…: a local store, never a tracking server
        self.client = MlflowClient(tracking_uri=self.store_uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(PROJECT)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(PROJECT)
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")  # a resumed run is running again
        self.run_id: str = run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [Metric(mlflow_metric_name(tag), value, now, step) for tag, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=points)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED")


class WandbTracker:
    """One W&B run in offline mode under RUN/wandb; a resumed run keeps the run id (a second offline-run folder of
    the same id, which `wandb sync` appends to the same run).

    W&B wants one increasing step per run, but the loop's figures count iterations and the trainer's count
    optimizer steps; so each metric group (`loop/`, `eval/`, `train/`) is plotted against its own step metric
    `steps/GROUP` (W&B's `define_metric`)."""

    def __init__(self, run_dir: Path, run_id: str, run_name: str) -> None:
        offline_environment()
        own_wandb_service()
        import wandb

        settings = wandb.Settings(
            mode="offline",
            silent=True,
            console="off",  # the loop's console is its own
            save_code=False,
            disable_git=True,
            x_disable_stats=True,  # no system-metrics sampler beside the engine and the trainer
            x_disable_meta=True,
        )
        self.run = self._init(wandb, settings, run_dir, run_id, run_name)
        self.run_id = run_id
        self.groups: set[str] = set()
        # the last step per metric in this run's offline files (earlier processes'), not trackers.json's: see the
        # module docstring
        self.logged_steps = wandb_logged_steps(run_dir, run_id)

    @staticmethod
    def _init(wandb, settings, run_dir: Path, run_id: str, run_name: str, wait_s: float = 60.0):
        """`wandb.init` of the run; after a kill, the killed process's W&B service holds the run id until it notices
        its parent is gone ("run ID … is in use"): a resume waits for it to let go."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return wandb.init(
                    project=PROJECT,
                    dir=str(run_dir),
                    id=run_id,
                    name=run_name,
                    resume="allow",
                    settings=settings,
                )
            except Exception as exc:
                if "in use" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        by_group: dict[str, dict[str, float]] = {}
        for tag, value in metrics.items():
            by_group.setdefault(tag.split("/", 1)[0], {})[tag] = value
        for group, values in by_group.items():
            axis = f"steps/{group}"
            if group not in self.groups:
                self.run.define_metric(axis)
                self.run.define_metric(f"{group}/*", step_metric=axis)
                self.groups.add(group)
            self.run.log({**values, axis: step})

    def close(self) -> None:
        self.run.finish()


def wandb_records(path: Path) -> list:
    """The records of one offline `.wandb` file: W&B's LevelDB-style log (a 7-byte file header, 32 KiB blocks of
    chunks with a 7-byte header: CRC, length, type), each record one of W&B's own `Record` protobufs. A record cut
    off by a kill ends the list."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    if data[:4] != b":W&B":
        return []
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
        if position + 7 + length > len(data):
            break
        payload += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def wandb_history(run_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """The logged rows of every offline folder of W&B run `run_id` under RUN/wandb, in order."""
    rows = []
    for folder in sorted((run_dir / WANDB_DIR).glob(f"offline-run-*-{run_id}")):
        for record in wandb_records(folder / f"run-{run_id}.wandb"):
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return rows


def wandb_logged_steps(run_dir: Path, run_id: str) -> dict[str, int]:
    """The last step of each metric in W&B run `run_id`'s offline files (each against its group's `steps/GROUP`)."""
    last: dict[str, int] = {}
    for row in wandb_history(run_dir, run_id):
        for tag in row:
            axis = f"steps/{tag.split('/', 1)[0]}"
            if not tag.startswith(("_", "steps/")) and axis in row:
                last[tag] = max(last.get(tag, -1), int(row[axis]))
    return last


@dataclass
class TrackerState:
    """RUN/trackers.json: the tracked runs' ids and the last step logged per metric (so a resume goes on where the
    trackers stopped)."""

    mlflow_run_id: str | None = None
    wandb_run_id: str | None = None
    last_steps: dict[str, int] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> TrackerState:
        if not path.exists():
            return cls()
        raw = json.loads(path.read_text())
        return cls(raw.get("mlflow_run_id"), raw.get("wandb_run_id"), dict(raw.get("last_steps") or {}))

    def write(self, path: Path) -> None:
        """Atomically: a kill while writing leaves the previous state whole."""
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(json.dumps(self.__dict__, indent=1, sort_keys=True))
        os.replace(partial, path)


class RunTrackers:
    """The `--report-to` trackers of one loop run, fed the same points; each (metric, step) logged once over the
    run, so a step the loop repeats after a resume is not drawn twice."""

    def __init__(self, trackers: list[Tracker], state: TrackerState, state_path: Path) -> None:
        self.trackers = trackers
        self.state = state
        self.state_path = state_path
        self.lock = threading.Lock()  # with --overlap the trainer thread forwards its metrics too

    def log(self, metrics: dict[str, float], step: int) -> None:
        with self.lock:
            shared = self.state.last_steps  # the trackers whose points are on disk once logged
            fresh_shared = {tag: value for tag, value in metrics.items() if unlogged(shared, tag, step)}
            for tracker in self.trackers:
                own: dict[str, int] | None = getattr(tracker, "logged_steps", None)  # W&B: its own files
                fresh = (
                    fresh_shared
                    if own is None
                    else {tag: value for tag, value in metrics.items() if unlogged(own, tag, step)}
                )
                if fresh:
                    tracker.log(fresh, step)
                    if own is not None:
                        own.update(dict.fromkeys(fresh, step))
            if fresh_shared:
                shared.update(dict.fromkeys(fresh_shared, step))
                self.state.write(self.state_path)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def unlogged(last_steps: dict[str, int], tag: str, step: int) -> bool:
    """Whether (tag, step) is new to a tracker that logged up to `last_steps[tag]` (any step, -1 for --eval-start's
    evaluation of the starting weights included, is new for a tag never logged)."""
    return tag not in last_steps or step > last_steps[tag]


def tracker_names(report_to: str) -> list[str]:
    """The trackers of `--report-to NAME[,NAME…]` (`none`: none), refused when unknown."""
    names = [name.strip() for name in report_to.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown or not names:
        raise TrackerUnavailable(
            f"--report-to {report_to}: not one of {' | '.join(TRACKERS)} (or a comma list)"
        )
    return [name for name in dict.fromkeys(names) if name != "none"]


def check_tracker(report_to: str) -> None:
    """Refuse, before anything starts, a tracker that is unknown or whose package is not installed."""
    for name in tracker_names(report_to):
        package = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            extra = "train" if name == "tensorboard" else "trackers"
            raise TrackerUnavailable(
                f"--report-to {name}: the {package} package is not installed (pip install 'polar-mitm[{extra}]')"
            )


def open_tracker(report_to: str, run_dir: Path, resume: bool = False) -> Tracker:
    """The trackers of `--report-to` for a run in `run_dir`: one tracked run each. `resume=True` continues the runs
    whose ids RUN/trackers.json keeps (a new run when there is none); otherwise new runs start."""
    names = tracker_names(report_to)
    check_tracker(report_to)
    if not names:
        return NoTracker()
    run_dir.mkdir(parents=True, exist_ok=True)
    state_path = run_dir / TRACKER_STATE
    state = TrackerState.read(state_path) if resume else TrackerState()
    trackers: list[Tracker] = []
    try:
        for name in names:
            trackers.append(_open_one(name, run_dir, state))
    except BaseException:
        for opened in trackers:  # the ones that did open are not left half-written
            opened.close()
        raise
    state.write(state_path)
    return RunTrackers(trackers, state, state_path)


def _open_one(name: str, run_dir: Path, state: TrackerState) -> Tracker:
    """One tracker of the run, its run id noted in `state` (a new one unless `state` has it already)."""
    if name == "tensorboard":
        return TensorBoardTracker(run_dir / TENSORBOARD_DIR)
    if name == "mlflow":
        mlflow = MlflowTracker(run_dir / MLFLOW_DIR, state.mlflow_run_id, run_dir.name)
        state.mlflow_run_id = mlflow.run_id
        return mlflow
    state.wandb_run_id = state.wandb_run_id or uuid.uuid4().hex[:12]
    return WandbTracker(run_dir, state.wandb_run_id, run_dir.name)


def numeric_metrics(row: dict[str, Any], prefix: str) -> dict[str, float]:
    """The finite numbers of a metrics row, tagged `prefix/key` (nested dicts flattened as `prefix/key/sub`)."""
    metrics: dict[str, float] = {}
    for key, value in row.items():
        if key in NOT_METRICS:
            continue
        if isinstance(value, dict):
            metrics.update(numeric_metrics(value, f"{prefix}/{key}"))
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            metrics[f"{prefix}/{key}"] = float(value)
    return metrics


def log_training_metrics(tracker: Tracker, metrics_file: Path) -> int:
    """Forward one training's metrics.jsonl rows at their run-wide step; returns how many rows were logged."""
    from polar_mitm.train.metrics import read_metrics

    if not metrics_file.exists():
        return 0
    rows = read_metrics(metrics_file)
    for row in rows:
        tracker.log(numeric_metrics(row, "train"), step=int(row.get("run_step", row["step"])))
    return len(rows)
