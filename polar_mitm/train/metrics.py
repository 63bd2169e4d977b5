"""Training metrics: one JSON object per logged step in `metrics.jsonl` (TensorBoard gets the same numbers through
transformers' own callback), and `plot_run` to turn a run's JSONL into PNG curves."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from polar_mitm.storage.location import InputNotFound

# (panel title, metric keys) in display order; panels with no data are skipped.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss",)),
    ("reward", ("reward", "reward_std")),
    (
        "advantages (per session; token_mean per loss token)",
        ("advantages/mean", "advantages/std", "advantages/min", "advantages/max", "advantages/token_mean"),
    ),
    (
        "clip ratio, TIS cap (share of stale tokens at it)",
        (
            "clip_ratio/region_mean",
            "clip_ratio/low_mean",
            "clip_ratio/high_mean",
            "importance_weight/frac_capped",
        ),
    ),
    ("KL to reference (per loss token)", ("kl", "kl/k1", "kl/k2", "kl/k3")),
    (
        "importance ratio (stale rollouts, log scale)",
        ("importance_ratio/mean", "importance_ratio/min", "importance_ratio/max", "importance_weight/mean"),
    ),
    ("staleness (weight versions)", ("staleness/mean", "staleness/max")),
    ("throughput (tokens/s)", ("tokens_per_second",)),
    ("entropy", ("entropy",)),
    ("grad norm", ("grad_norm",)),
)


class JsonlMetricsCallback(TrainerCallback):
    """Append every `on_log` payload to a JSONL file, with the step, wall time and tokens/s since the last log.

    `run_step` is the optimizer step over the whole run (`step_offset`: the steps of the trainings before this one,
    when a loop carries one optimizer across them). A resumed run first drops the records after the checkpoint's
    step — steps logged after the last checkpoint, before the stop — so every step is written once.
    """

    def __init__(self, path: str | Path, step_offset: int = 0) -> None:
        self.path = Path(path)
        self.step_offset = step_offset
        self._last_time: float | None = None
        self._last_tokens = 0

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.path.exists():
            if state.global_step == 0:
                self.path.unlink()  # a fresh run in a reused directory
            else:
                self._keep_records_up_to(state.global_step)  # resumed from the checkpoint of that step
        self._last_time = time.time()
        self._last_tokens = state.num_input_tokens_seen or 0

    def _keep_records_up_to(self, step: int) -> None:
        """The step records up to `step`; the stopped training's closing summary goes too (the resumed one writes
        its own)."""
        records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        kept = [r for r in records if r["step"] <= step and "train_runtime" not in r]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        now = time.time()
        record: dict[str, Any] = {
            "step": state.global_step,
            "run_step": self.step_offset + state.global_step,
            "epoch": state.epoch,
            "time": now,
        }
        record.update({k: _jsonable(v) for k, v in logs.items()})
        tokens = logs.get("num_tokens")
        if tokens is not None and self._last_time is not None and now > self._last_time:
            record["tokens_per_second"] = (tokens - self._last_tokens) / (now - self._last_time)
            self._last_time, self._last_tokens = now, tokens
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (or of `<run dir>/metrics.jsonl`)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise InputNotFound(f"no metrics at {path}: not a `polar-mitm grpo` output folder")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run: str | Path, out: str | Path | None = None) -> Path:
    """Plot a run's per-step metrics into one PNG of curves; return its path (default `<run>/plots/curves.png`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    run = Path(run)
    records = [r for r in read_metrics(run) if "train_runtime" not in r]
    panels = [
        (title, keys) for title, keys in PANELS if any(r.get(k) is not None for r in records for k in keys)
    ]
    if not panels:
        raise ValueError(f"no plottable metrics in {run}")
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=key)
        if "log scale" in title:  # ratios are multiplicative; a linear axis hides everything under the max
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(run.name)
    fig.tight_layout()
    out = Path(out) if out else run / "plots" / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
