"""The loop's live report: `RUN/report.html` rewritten after every iteration, so a browser reload shows a long
run's progress — the curves with the held-out evaluation, resume points and group counts — while it runs.

The loop calls `refresh_report` from `Loop._report` with the iteration it has just finished; that row joins what
loop.json already holds (the loop may write loop.json after reporting), and the page replaces the old one in one
`os.replace`, so a reload never shows half a page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polar_mitm.report.collect import RunData, collect_run
from polar_mitm.report.render import render_html, write_atomically
from polar_mitm.storage.run_layout import iteration_index

REPORT_FILE = "report.html"  # under the run directory


def refresh_report(run_dir: str | Path, latest: dict[str, Any] | None = None, *, sessions: int = 6) -> Path:
    """(Re)write `run_dir/report.html` from what the run holds now, plus `latest` (an `IterationStats.to_json()`
    row not yet in loop.json); return its path."""
    run = collect_run(run_dir)
    if latest is not None:
        with_iteration(run, latest)
    out = run.root / REPORT_FILE
    write_atomically(out, render_html(run, sessions=sessions))
    return out


def with_iteration(run: RunData, row: dict[str, Any]) -> None:
    """Give the stage of `row`'s iteration (`iter-K`) its loop.json row, unless loop.json had it already."""
    for stage in run.stages:
        if iteration_index(stage.root) == row["iteration"] and stage.stats is None:
            stage.stats = row
