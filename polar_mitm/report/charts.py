"""The report's curves, drawn by matplotlib as inline SVG (text kept as text, so the page stays small and sharp).

Why matplotlib: it is already the project's plotting library (`polar-mitm plot`, `stats`, the demo's PNG), it
writes standalone SVG that any browser shows with no script and no network, and it is well kept. An interactive
JS library would have to be inlined into every report (plotly.js is ~4 MB, Bokeh's ~1 MB) for hover on curves
the report does not need — the token viewer, where hover matters, is plain HTML.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polar_mitm.report.collect import RunData, resume_points, reward_summary

# (chart id, title, y label, metric keys) of the per-step training curves, in display order.
STEP_CHARTS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("loss", "loss", "loss", ("loss",)),
    ("kl", "KL to the reference model", "KL", ("kl",)),
    (
        "clip",
        "clip ratio",
        "fraction of tokens",
        ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"),
    ),
    ("staleness", "staleness (weight versions behind)", "versions", ("staleness/mean", "staleness/max")),
)


@dataclass
class Chart:
    """One figure of the report: its id (for the page and its tests), title, and SVG markup or why it is empty."""

    chart_id: str
    title: str
    svg: str | None
    note: str = ""


def step_series(run: RunData) -> tuple[list[dict[str, Any]], list[int]]:
    """All training log rows of the run on one global step axis, and the steps where a new iteration starts."""
    rows: list[dict[str, Any]] = []
    boundaries: list[int] = []
    offset = 0
    for stage in run.stages:
        if not stage.metrics:
            continue
        if rows:
            boundaries.append(offset)
        for row in stage.metrics:
            rows.append({**row, "global_step": offset + int(row.get("step") or 0)})
        offset += max(int(r.get("step") or 0) for r in stage.metrics)
    return rows, boundaries


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def build_charts(run: RunData) -> list[Chart]:
    """The reward chart (a loop's group counts beside it), then one chart per training metric group (an empty one
    says why it is empty)."""
    charts = [reward_chart(run)]
    if run.kind == "loop":
        charts.append(groups_chart(run))
        charts.append(updates_chart(run))
    rows, boundaries = step_series(run)
    for chart_id, title, ylabel, keys in STEP_CHARTS:
        series = {key: [(r["global_step"], r[key]) for r in rows if _finite(r.get(key))] for key in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            why = "no training metrics in this run" if not rows else f"not logged ({', '.join(keys)})"
            if chart_id == "kl" and rows:
                why = "not logged: beta = 0 (no reference model, no KL term)"
            charts.append(Chart(chart_id, title, None, why))
            continue
        charts.append(Chart(chart_id, title, line_svg(series, boundaries, ylabel=ylabel, salt=chart_id)))
    return charts


def reward_chart(run: RunData) -> Chart:
    """Mean session reward (±std) per iteration; for a single train run, the per-step reward of its batches."""
    points = [
        (i, summary) for i, stage in enumerate(run.stages) if (summary := reward_summary(stage)) is not None
    ]
    if run.kind == "loop" and points:
        held_out = held_out_points(run)
        resumed = sorted({int(e["iteration"]) for e in resume_points(run) if e.get("iteration") is not None})
        title = "mean session reward per iteration (±std)" + (", held-out pass@1" if held_out else "")
        title += ", dashed: resumed" if resumed else ""
        return Chart("reward", title, errorbar_svg(points, held_out, resumed))
    rows, boundaries = step_series(run)
    series = {"reward": [(r["global_step"], r["reward"]) for r in rows if _finite(r.get("reward"))]}
    if series["reward"]:
        return Chart(
            "reward",
            "reward of the training batches",
            line_svg(series, boundaries, ylabel="reward", salt="reward"),
        )
    if points:
        return Chart("reward", "mean session reward (±std)", errorbar_svg(points))
    return Chart("reward", "reward", None, "no rewards in this run")


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 2.9))
    ax.grid(alpha=0.3)
    return plt, fig, ax


def _svg(plt, fig, salt: str) -> str:
    """The figure as one <svg> element: text kept as text, ids salted per chart so inline figures never clash."""
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"polar-report-{salt}"}):
        buffer = io.StringIO()
        fig.tight_layout()
        fig.savefig(
            buffer, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None}
        )
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # drop the XML declaration and DOCTYPE: the SVG is inlined in HTML


def held_out_points(run: RunData) -> list[tuple[int, float]]:
    """The loop's held-out pass@1 (`--eval-tasks`) per iteration that was evaluated."""
    return [
        (i, float(stage.stats["eval"]["pass_at"]["pass@1"]))
        for i, stage in enumerate(run.stages)
        if stage.stats and stage.stats.get("eval") and "pass@1" in stage.stats["eval"]["pass_at"]
    ]


def group_counts(run: RunData) -> list[tuple[int, int, int, int]]:
    """(iteration, groups, all-equal groups, replaced groups) of the iterations whose loop.json row has the counts
    (rows written before the loop counted groups have none: unknown, not zero)."""
    counts = []
    for i, stage in enumerate(run.stages):
        s = stage.stats or {}
        if all(isinstance(s.get(key), int) for key in ("groups", "uninformative_groups", "replaced_groups")):
            counts.append((i, s["groups"], s["uninformative_groups"], s["replaced_groups"]))
    return counts


def groups_chart(run: RunData) -> Chart:
    """Per iteration: the groups rolled out, those whose rewards were all equal (nothing to learn), and those
    replaced by fresh groups (--min-informative-groups)."""
    counts = group_counts(run)
    title = "groups per iteration: all / all-equal rewards / replaced"
    if not counts:
        return Chart("groups", title, None, "no group counts in this run's loop.json (unknown)")
    plt, fig, ax = _figure()
    width = 0.27
    for offset, (label, column) in enumerate((("groups", 1), ("all-equal rewards", 2), ("replaced", 3))):
        xs = [c[0] + (offset - 1) * width for c in counts]
        ax.bar(xs, [c[column] for c in counts], width=width, label=label)
    ax.set_xticks([c[0] for c in counts])
    ax.set_xlabel("iteration")
    ax.set_ylabel("groups")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize="small")
    return Chart("groups", title, _svg(plt, fig, "groups"))


def updates_chart(run: RunData) -> Chart:
    """Per iteration: the pause its weight push caused the running sessions (ms), and the share of its trained
    tokens that older weights sampled (a push mid-call splits a call's tokens between versions)."""
    title = "weight updates: push pause (ms) and trained tokens sampled by older weights (%)"
    rows = [(i, stage.stats or {}) for i, stage in enumerate(run.stages)]
    pauses = [(i, s["push"]["pause_seconds"] * 1000) for i, s in rows if isinstance(s.get("push"), dict)]
    stale = []
    for i, s in rows:
        counts = s.get("token_staleness") or {}
        total = sum(counts.values())
        if total:
            stale.append((i, 100 * sum(n for k, n in counts.items() if int(k) > 0) / total))
    if not pauses and not stale:
        return Chart("updates", title, None, "no push or per-token staleness in this run's loop.json")
    plt, fig, ax = _figure()
    if pauses:
        ax.bar([i for i, _ in pauses], [p for _, p in pauses], width=0.4, label="push pause (ms)")
        ax.set_ylabel("ms")
    if stale:
        other = ax.twinx()
        other.plot(
            [i for i, _ in stale], [p for _, p in stale], marker="o", color="C1", label="stale tokens (%)"
        )
        other.set_ylabel("% of trained tokens")
        other.set_ylim(0, 100)
        other.legend(fontsize="small", loc="upper right")
    ax.set_xlabel("iteration")
    if pauses:
        ax.legend(fontsize="small", loc="upper left")
    return Chart("updates", title, _svg(plt, fig, "updates"))


def errorbar_svg(
    points: Sequence[tuple[int, tuple[float, float]]],
    held_out: Sequence[tuple[int, float]] = (),
    resumed: Sequence[int] = (),
) -> str:
    plt, fig, ax = _figure()
    for n, iteration in enumerate(resumed):  # where a killed run was taken up again (RUN/events.jsonl)
        ax.axvline(iteration, color="grey", linestyle="--", linewidth=1, label="resumed" if n == 0 else None)
    xs = [x for x, _ in points]
    ax.errorbar(
        xs,
        [m for _, (m, _) in points],
        yerr=[s for _, (_, s) in points],
        marker="o",
        capsize=3,
        label="training reward",
    )
    if held_out:  # beside the training reward: does the policy generalise to tasks it never trains on
        ax.plot([x for x, _ in held_out], [y for _, y in held_out], marker="s", label="held-out pass@1")
    if held_out or resumed:
        ax.legend(fontsize="small")
    ax.set_xticks(xs)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.set_ylim(min(-0.05, ax.get_ylim()[0]), max(1.05, ax.get_ylim()[1]))
    return _svg(plt, fig, "reward")


def line_svg(
    series: dict[str, list[tuple[int, float]]], boundaries: Sequence[int], *, ylabel: str, salt: str
) -> str:
    plt, fig, ax = _figure()
    for name, points in series.items():
        ax.plot(
            [x for x, _ in points],
            [y for _, y in points],
            marker="." if len(points) < 40 else None,
            label=name,
        )
    for step in boundaries:
        ax.axvline(step + 0.5, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("training step" + (" (dotted: next iteration)" if boundaries else ""))
    ax.set_ylabel(ylabel)
    if len(series) > 1:
        ax.legend(fontsize="small")
    return _svg(plt, fig, salt)
