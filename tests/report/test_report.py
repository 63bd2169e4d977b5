"""`polar-mitm report`: one self-contained HTML page from a real loop run (the demo's loop, shortened) and from
single rollout/merge/train directories; and the loop's live report — RUN/report.html rewritten after every
iteration of the shared evaluated loop (tests/loop/evaluated_loop.py), with its held-out pass@k, group counts,
and resume points from a hand-written RUN/events.jsonl."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from polar_mitm.report import write_report
from tests.loop.evaluated_loop import evaluated_loop_run, report_after

pytestmark = pytest.mark.slow

POLAR = str(Path(sys.executable).with_name("polar-mitm"))


class Elements(HTMLParser):
    """Start tags with their attributes, in document order."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def parse(html: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = Elements()
    parser.feed(html)
    return parser.tags


@pytest.fixture(scope="module")
def report_html(demo_run) -> str:
    run_dir, _ = demo_run
    return write_report(run_dir).read_text()


def test_report_is_self_contained(report_html):
    tags = parse(report_html)
    # Nothing is loaded from anywhere: no external script, stylesheet, image or frame.
    for tag, attrs in tags:
        for name in ("src", "href"):
            value = attrs.get(name) or ""
            assert not re.match(r"(https?:)?//", value), (tag, attrs)
    assert not any(tag in ("iframe", "link") and attrs.get("rel") == "stylesheet" for tag, attrs in tags)
    assert "<style>" in report_html and "<script>" in report_html


def test_report_shows_iterations_curves_merge_tasks(report_html, demo_run):
    _, results = demo_run
    ids = {attrs.get("id") for _, attrs in parse(report_html)}
    assert {"iterations", "charts", "merge", "tasks", "viewer", "tip"} <= ids
    assert {f"chart-{name}" for name in ("reward", "loss", "kl", "clip", "staleness", "updates")} <= ids
    iteration_table = report_html.split('id="iterations"')[1].split("</table>")[0]
    assert iteration_table.count("<tr>") == 1 + len(results)
    assert f"{results[-1].reward_mean:.3f}" in iteration_table
    # Curves are drawn (inline SVG with paths), KL says why it is empty (beta = 0 in the loop).
    for name in (
        "reward",
        "loss",
        "clip",
        "staleness",
        "updates",
    ):  # updates: each push's pause, stale tokens
        figure = report_html.split(f'id="chart-{name}"')[1].split("</figure>")[0]
        assert "<svg" in figure and "<path" in figure, name
    assert "beta = 0" in report_html.split('id="chart-kl"')[1].split("</figure>")[0]
    merge = report_html.split('id="merge"')[1].split("</table>")[0]
    summary = json.loads((demo_run[0] / "iter-0" / "merged" / "_summary.json").read_text())
    exact = f"{summary['context_exact_tokens']}/{summary['context_checked_tokens']}"
    assert "context-exact sampled tokens" in merge and exact in merge
    tasks = report_html.split('id="tasks"')[1].split("</table>")[0]
    assert all(task in tasks for task in ("hello-file", "fix-typo", "append-done"))


def test_token_viewer_carries_ids_logprobs_masks_and_turns(report_html, demo_run):
    tokens = [
        attrs for tag, attrs in parse(report_html) if tag == "span" and "tk" in (attrs.get("class") or "")
    ]
    sampled = [a for a in tokens if "m1" in (a.get("class") or "")]
    assert len(tokens) > 500 and 0 < len(sampled) < len(tokens)
    assert all(float(a["data-lp"]) < 0 and "--s:" in (a.get("style") or "") for a in sampled)
    assert all(float(a["data-lp"]) == 0 for a in tokens if a not in sampled)
    assert report_html.count('class="turn"') >= 2 * 6  # two turns per session, six sessions
    assert "&lt;|im_start|&gt;" in report_html  # decoded with the engine's tokenizer, escaped


def test_report_command_on_stage_directories(demo_run, tmp_path):
    run_dir, _ = demo_run
    for stage in ("iter-0/merged", "iter-0/train", "iter-0"):
        out = tmp_path / (stage.replace("/", "-") + ".html")
        done = subprocess.run(
            [POLAR, "report", str(run_dir / stage), "-o", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert out.exists() and "<svg" in out.read_text()
    empty = subprocess.run(
        [POLAR, "report", str(tmp_path / "nothing-here")], capture_output=True, text=True, timeout=120
    )
    assert empty.returncode == 2 and "not a directory" in empty.stderr


# -- the loop's live report (RUN/report.html rewritten after every iteration) --------------------------------------


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory) -> Path:
    """The session's shared evaluated 2-iteration loop (tests/loop/evaluated_loop.py)."""
    return evaluated_loop_run(tmp_path_factory)


def table_rows(html: str, table_id: str) -> list[str]:
    """The data rows (after the header) of the table with id `table_id`."""
    table = html.split(f'id="{table_id}"')[1].split("</table>")[0]
    return table.split("<tr")[2:]


def test_loop_rewrites_the_report_after_every_iteration(evaluated_run):
    iterations = json.loads((evaluated_run / "loop.json").read_text())
    for it in iterations:
        page = report_after(evaluated_run, it["iteration"]).read_text()
        rows = table_rows(page, "iterations")
        assert len(rows) == it["iteration"] + 1  # the iterations finished so far, no more
        assert f"{it['reward_mean']:.3f}" in rows[-1]
        assert f"pass@1 {it['eval']['pass_at']['pass@1']:.2f}" in rows[-1]  # its held-out evaluation
        informative = it["groups"] - it["uninformative_groups"]
        assert f"{informative}/{it['groups']}" in rows[-1]
        assert 'id="chart-reward"' in page and 'id="chart-groups"' in page
    # the final page is the last iteration's, written whole (no partial file left beside it)
    assert (evaluated_run / "report.html").read_text() == report_after(
        evaluated_run, iterations[-1]["iteration"]
    ).read_text()
    assert not list(evaluated_run.glob(".report.html*"))


def test_report_shows_resume_points_and_group_counts(evaluated_run, tmp_path):
    from polar_mitm.report.collect import collect_run, read_events
    from polar_mitm.report.render import render_html

    run = collect_run(evaluated_run)
    # A hand-written history: a run killed during iteration 1's training, resumed there; a cut last line (a kill
    # mid-append) is left out.
    events = [
        {"event": "start", "iteration": 0, "stage": "rollout", "time": 1_800_000_000},
        {"event": "iteration_done", "iteration": 0, "stage": None, "time": 1_800_000_060},
        {"event": "resume", "iteration": 1, "stage": "train", "time": 1_800_000_200, "sessions_kept": 4},
        {"event": "finished", "iteration": 1, "stage": None, "time": 1_800_000_300},
    ]
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "iterat')
    run.events = read_events(log)
    assert run.events == events
    html = render_html(run, sessions=1)
    history = table_rows(html, "history")
    assert [row.split('class="event-')[1].split('"')[0] for row in history] == ["start", "resume", "finished"]
    assert "train" in history[1] and "<td>1</td>" in history[1] and "sessions_kept 4" in history[1]
    reward = html.split('id="chart-reward"')[1].split("</figure>")[0]
    assert "dashed: resumed" in reward and "resumed" in reward.split("<svg")[1]
    assert "finished: 2 iterations" in html.split('id="status"')[1].split("</p>")[0]
    groups = html.split('id="chart-groups"')[1].split("</figure>")[0]
    assert "<svg" in groups and "all-equal rewards" in groups
    # loop.json rows written before the loop counted groups: unknown, not zero
    for stage in run.stages:
        for key in ("groups", "uninformative_groups", "replaced_groups"):
            stage.stats.pop(key)
    html = render_html(run, sessions=1)
    assert all('<td class="groups">—</td>' in row for row in table_rows(html, "iterations"))
    assert "unknown" in html.split('id="chart-groups"')[1].split("</figure>")[0]
