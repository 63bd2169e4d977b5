"""Fill the report template: one HTML file, CSS/JS/SVG inline, nothing loaded from anywhere when it opens."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polar_mitm.report.charts import build_charts
from polar_mitm.report.collect import RunData, engine_info, pass_rates, reward_summary
from polar_mitm.report.inputs import INPUT_KINDS, collect_inputs
from polar_mitm.report.sessions import records_context
from polar_mitm.report.trajectories import load_report_tokenizer, read_trajectories
from polar_mitm.storage.session_ends import ends_line

TEMPLATES = Path(__file__).resolve().parent / "templates"


def write_report(
    run_dir: str | Path | Sequence[str | Path],
    out: str | Path | None = None,
    *,
    tokenizer: str | None = None,
    sessions: int = 6,
) -> Path:
    """Write the report of `run_dir` — one folder, or several of one hand-run pipeline (`report/inputs.py`) — to
    `out` (default `report.html` in the (first) folder); return its path."""
    run = collect_inputs([run_dir] if isinstance(run_dir, str | Path) else run_dir)
    out = Path(out) if out is not None else run.root / "report.html"
    write_atomically(out, render_html(run, tokenizer=tokenizer, sessions=sessions))
    return out


def write_atomically(out: Path, html: str) -> None:
    """Write `out` whole or not at all: a browser reloading the page mid-write never sees half of it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(html, encoding="utf-8")
    os.replace(partial, out)


def render_html(run: RunData, *, tokenizer: str | None = None, sessions: int = 6) -> str:
    """The report page of `run` as one string."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env.get_template("report.html.j2").render(
        **page_context(run, tokenizer=tokenizer, sessions=sessions)
    )


def page_context(run: RunData, *, tokenizer: str | None, sessions: int) -> dict[str, Any]:
    """Everything the template shows, as plain values."""
    viewer_stage = next((s for s in reversed(run.stages) if s.merged_dir is not None), None)
    trajectories, viewer_note = [], "no merged sequences in this run"
    if viewer_stage is not None:
        tok = load_report_tokenizer(run, tokenizer)
        trajectories = read_trajectories(viewer_stage.merged_dir, tok, limit=sessions)
        viewer_note = (
            f"{len(trajectories)} sessions from {viewer_stage.label} ({viewer_stage.merged_dir})"
            + ("" if tok is not None else " — no tokenizer found: token ids shown")
        )
    sources = [i.path for i in run.inputs] or [run.root]
    return {
        "title": "polar-mitm report · " + " + ".join(p.name for p in sources),
        "root": " + ".join(str(p) for p in sources),
        "inputs": [{"path": str(i.path), "kinds": ", ".join(i.kinds)} for i in run.inputs],
        "generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "headline": headline(run),
        "status": run_status(run),
        "iterations": iteration_rows(run),
        "history": history_rows(run),
        "charts": build_charts(run),
        "records": records_context(run),
        "merge_rows": merge_rows(run),
        "task_table": task_table(run),
        "engine": engine_info(run),
        "trajectories": trajectories,
        "viewer_note": viewer_note,
    }


def headline(run: RunData) -> str:
    """One line: how the reward moved (or what the directory is)."""
    rewards = [summary for s in run.stages if (summary := reward_summary(s)) is not None]
    if len(rewards) >= 2:
        return f"reward {rewards[0][0]:.2f} → {rewards[-1][0]:.2f} in {len(rewards)} iterations"
    if rewards:
        return f"mean reward {rewards[0][0]:.2f}"
    if run.inputs:
        return " → ".join(k for k in INPUT_KINDS if any(k in i.kinds for i in run.inputs)) + " (no rewards)"
    return f"{run.kind} directory"


def iteration_rows(run: RunData) -> list[dict[str, str]]:
    """The loop's per-iteration table (as the console prints it), or one row per stage with what is known."""
    rows = []
    for stage in run.stages:
        s = stage.stats
        if s is None:
            continue
        seconds = s.get("seconds") or {}
        rows.append(
            {
                "iteration": str(s["iteration"]),
                "weights": str(s.get("weight_version")),
                "sessions": str(s["sessions"]),
                "reward": f"{s['reward_mean']:.3f} ± {s['reward_std']:.2f}",
                "pass": f"{s['pass_rate']:.0%}",
                "calls": str(s["requests"]),
                "sequences": str(s["sequences"]),
                "tokens": f"{s['trainable_tokens']}/{s['total_tokens']}",
                "seconds": " / ".join(f"{seconds.get(k, 0):.0f}" for k in ("rollout", "merge", "train")),
                "groups": groups_cell(s),
                "held_out": held_out_cell(s),
                # loop.json rows written before ends were counted have none: `—`
                "ends": ends_line(s.get("session_ends") or {}, s.get("end_rules")),
            }
        )
    return rows


def groups_cell(stats: dict[str, Any]) -> str:
    """`informative/all (replaced R)` from the loop's group counts; `—` for rows written before it counted them."""
    groups, equal, replaced = (stats.get(k) for k in ("groups", "uninformative_groups", "replaced_groups"))
    if not isinstance(groups, int) or not isinstance(equal, int):
        return "—"
    return f"{groups - equal}/{groups}" + (f" (replaced {replaced})" if isinstance(replaced, int) else "")


def held_out_cell(stats: dict[str, Any]) -> str:
    """The held-out pass@k of the iteration's evaluation (`--eval-tasks`), or `—` when none was due."""
    evaluation = stats.get("eval")
    if not evaluation:
        return "—"
    return " · ".join(f"{k} {v:.2f}" for k, v in evaluation["pass_at"].items())


def history_rows(run: RunData) -> list[dict[str, str]]:
    """The run's starts, resumes and end (RUN/events.jsonl), with when and where: a resume row says the iteration
    and stage a killed run was taken up at."""
    rows = []
    for event in run.events:
        if event["event"] not in ("start", "resume", "finished"):
            continue
        details = {k: v for k, v in event.items() if k not in ("event", "iteration", "stage", "time")}
        rows.append(
            {
                "event": str(event["event"]),
                "time": _utc(event.get("time")),
                "iteration": "—" if event.get("iteration") is None else str(event["iteration"]),
                "stage": str(event.get("stage") or "—"),
                "details": ", ".join(f"{k} {v}" for k, v in details.items()),
            }
        )
    return rows


def run_status(run: RunData) -> str:
    """How far the loop is, for a page that is rewritten while it runs."""
    if run.kind != "loop":
        return ""
    done = sum(s.stats is not None for s in run.stages)
    if run.events and run.events[-1]["event"] == "finished":
        return f"finished: {done} iterations"
    if not run.events:
        return f"{done} iterations"
    last = run.events[-1]  # the loop writes its last page before it logs `finished`: "so far", not "running"
    return (
        f"{done} iterations so far (last event: {last['event']} at {_utc(last.get('time'))}); "
        "the loop rewrites this page after every iteration — reload it to follow the run"
    )


def _utc(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "—"
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def merge_rows(run: RunData) -> list[dict[str, str]]:
    """Per stage: requests → sequences, trainable tokens, and the context-exact share where merge measured it."""
    rows = []
    for stage in run.stages:
        m = stage.merge_summary
        if m is None:
            continue
        checked, exact = m.get("context_checked_tokens") or 0, m.get("context_exact_tokens") or 0
        rows.append(
            {
                "stage": stage.label,
                "builder": str(m.get("builder")),
                "requests": f"{m.get('trainable_records', 0)} of {m.get('records', 0)}",
                "sequences": str(m.get("sequences", 0)),
                "per_sequence": f"{m.get('records_per_sequence', 0):.1f}",
                "trainable": f"{m.get('trainable_tokens', 0)} / {m.get('total_tokens', 0)}",
                "context_exact": f"{exact}/{checked} ({exact / checked:.0%})" if checked else "—",
                "breaks": ", ".join(f"{k} {v}" for k, v in (m.get("breaks") or {}).items()) or "none",
                "ends": ends_line(m.get("session_ends") or {}, m.get("end_rules")),
                "eot": f"{m.get('eot_token_id')} ({m.get('eot_source')})"
                if m.get("eot_token_id") is not None
                else "—",
            }
        )
    return rows


def task_table(run: RunData) -> dict[str, Any]:
    """Pass rate per task (rows) and stage (columns): 'passed/sessions' cells with the rate for colouring."""
    stages = [s for s in run.stages if s.rewards]
    rates = [pass_rates(s) for s in stages]
    tasks = sorted({task for r in rates for task in r})
    rows = []
    for task in tasks:
        cells = []
        for r in rates:
            if task in r:
                passed, total, mean = r[task]
                cells.append({"text": f"{passed}/{total}", "rate": passed / total, "mean": f"{mean:.2f}"})
            else:
                cells.append({"text": "—", "rate": None, "mean": ""})
        rows.append({"task": task, "cells": cells})
    return {"stages": [s.label for s in stages], "rows": rows}
