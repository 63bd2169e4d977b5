"""`polar-mitm report`: one self-contained HTML page from a real loop run (the demo's loop, shortened) and from
single rollout/merge/train directories."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from polar_mitm.report import write_report

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
    assert {f"chart-{name}" for name in ("reward", "loss", "kl", "clip", "staleness")} <= ids
    iteration_table = report_html.split('id="iterations"')[1].split("</table>")[0]
    assert iteration_table.count("<tr>") == 1 + len(results)
    assert f"{results[-1].reward_mean:.3f}" in iteration_table
    # Curves are drawn (inline SVG with paths), KL says why it is empty (beta = 0 in the loop).
    for name in ("reward", "loss", "clip", "staleness"):
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
