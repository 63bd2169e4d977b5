"""`polar-mitm report flows/ merged/ runs/grpo`: one report of a hand-run rollout → merge → grpo (issue 38).

Real data throughout: the SDK sessions recorded in sample_flows/records (8 sessions, 24 calls of the tiny model) as
the records folder, merged with rewards by `polar_mitm.reconstruct.merge.merge`, and a real `polar-mitm grpo` on
the merged folder. The inputs are given in any order; each kind is found from what its folder holds, and the page
holds the sections each gives. A folder that is none of the kinds, two of one kind, or a loop run among them: one
line and exit 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.cli import main
from polar_mitm.reconstruct.merge import merge
from polar_mitm.user_errors import DEBUG_ENV

pytestmark = pytest.mark.slow  # a real GRPO training (~25 s on 2 cores)

POLAR = str(Path(sys.executable).with_name("polar-mitm"))
SAMPLE_RECORDS = Path(__file__).resolve().parents[2] / "sample_flows" / "records"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_model_dir) -> Path:
    """A folder holding flows/ (records), merged/ (with rewards: every other session passed) and runs/grpo."""
    root = tmp_path_factory.mktemp("pipeline")
    shutil.copytree(SAMPLE_RECORDS, root / "flows")
    sessions = sorted(set(pq.read_table(root / "flows", columns=["session_id"])["session_id"].to_pylist()))
    rewards = root / "rewards.jsonl"
    rewards.write_text(
        "".join(json.dumps({"session_id": s, "reward": float(i % 2)}) + "\n" for i, s in enumerate(sessions))
    )
    merge([str(root / "flows")], str(root / "merged"), rewards=str(rewards))
    trained = subprocess.run(
        [POLAR, "grpo", "--data", "merged", "-o", "runs/grpo", "--model", str(tiny_model_dir)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert (root / "runs" / "grpo" / "metrics.jsonl").exists()
    return root


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "")


class Ids(HTMLParser):
    """Every element id of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(value for name, value in attrs if name == "id" and value)


def ids_of(html: str) -> set[str]:
    parser = Ids()
    parser.feed(html)
    return parser.ids


def section(html: str, element_id: str, end: str = "</table>") -> str:
    return html.split(f'id="{element_id}"')[1].split(end)[0]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """`polar-mitm ARGV` in this process: (exit code, stderr)."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def test_one_report_holds_records_merge_tokens_and_training_curves(pipeline):
    out = pipeline / "pipeline.html"
    # In any order: each kind is found from what its folder holds.
    done = subprocess.run(
        [POLAR, "report", "runs/grpo", "flows", "merged", "-o", str(out)],
        cwd=pipeline,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    html = out.read_text()
    assert {"inputs", "records", "sessions", "merge", "tasks", "charts", "viewer"} <= ids_of(html)
    inputs = section(html, "inputs", "</p>")
    assert all(kind in inputs for kind in ("runs/grpo (grpo)", "flows (records)", "merged (merged)"))
    # records/sessions: the 24 recorded calls of 8 sessions, each with its reward
    records = section(html, "records")
    assert "<td>24</td>" in records and "<td>8</td>" in records
    sessions = section(html, "sessions").split("<tr")[2:]
    assert len(sessions) == 8 and all(
        "sample-task" in row and "tool_calls ×2 → stop" in row for row in sessions
    )
    assert sum("<td>1.00</td>" in row for row in sessions) == 4
    # merge statistics and the pass rate from the merged rewards
    summary = json.loads((pipeline / "merged" / "_summary.json").read_text())
    merge_table = section(html, "merge")
    assert f"{summary['trainable_records']} of {summary['records']}" in merge_table
    assert f"{summary['context_exact_tokens']}/{summary['context_checked_tokens']}" in merge_table
    assert "4/8" in section(html, "tasks")
    # training curves from runs/grpo/metrics.jsonl
    for name in ("reward", "loss", "clip"):
        figure = section(html, f"chart-{name}", "</figure>")
        assert "<svg" in figure and "<path" in figure, name
    assert "reward of the training batches" in section(html, "chart-reward", "</figure>")
    # the token viewer, decoded with the trained checkpoint's tokenizer (no engine file beside these records)
    viewer = section(html, "viewer", '<div id="tip"')
    assert viewer.count('class="traj"') == 6 and "&lt;|im_start|&gt;" in viewer
    assert "context tokens above the first sampled one" in viewer


def test_without_out_the_report_goes_into_the_first_folder(pipeline, capsys):
    target = pipeline / "merged" / "report.html"
    target.unlink(missing_ok=True)
    code, err = run_cli(capsys, "report", str(pipeline / "merged"), str(pipeline / "flows"))
    assert code == 0, err
    html = target.read_text()
    assert {"records", "sessions", "merge", "viewer"} <= ids_of(html)
    assert "no training metrics in this run" in section(html, "chart-loss", "</figure>")


def test_a_records_folder_alone_is_a_report(pipeline, capsys, tmp_path):
    out = tmp_path / "flows.html"
    code, err = run_cli(capsys, "report", str(pipeline / "flows"), "-o", str(out))
    assert code == 0, err
    html = out.read_text()
    assert len(section(html, "sessions").split("<tr")[2:]) == 8
    assert "no merge summary" in html and "no merged sequences" in html


def test_a_folder_of_no_kind_is_one_line_and_exit_2(pipeline, capsys, tmp_path):
    empty, missing, loop_run = tmp_path / "empty", tmp_path / "missing", tmp_path / "loop-run"
    empty.mkdir()
    (loop_run / "iter-0").mkdir(parents=True)
    flows, merged = str(pipeline / "flows"), str(pipeline / "merged")
    cases = [
        ([flows, merged, str(empty)], f"{empty}: not a records, rollout, merged or grpo folder"),
        ([flows, str(missing)], f"{missing} is not a directory"),
        ([flows, merged, merged], f"{merged} and {merged} are both merged folders"),
        ([str(loop_run), merged], f"{loop_run} is a loop run: report it on its own"),
    ]
    for paths, expected in cases:
        code, err = run_cli(capsys, "report", *paths, "-o", str(tmp_path / "never.html"))
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (paths, err)
        assert expected in lines[0], lines[0]
    assert not (tmp_path / "never.html").exists()
    # the installed script too
    done = subprocess.run([POLAR, "report", flows, str(empty)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and str(empty) in done.stderr
