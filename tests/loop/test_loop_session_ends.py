"""The loop's rules per session end, for real: one iteration whose sessions end completed, by a max_tokens cut and on
a malformed tool call (the scripted engine writes them; the harness is a client through the loop's gateway), with
`--on-length mask` and the default `--on-unparsed-tool-call zero` — counted in loop.json, the loop's table and the
report, and applied to what the iteration merged."""

from __future__ import annotations

import json
import sys

from rich.console import Console

from polar_mitm.loop.cli import iteration_table
from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.loop import Loop
from polar_mitm.storage.merged import read_merged
from polar_mitm.storage.rewards import read_rewards_table
from tests.rollout.test_session_ends import HARNESS, SCRIPT

CASES = {"fine": "completed", "long": "length", "broken": "unparsed"}


def test_a_loop_iteration_counts_every_end_and_applies_its_rule(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "harness.py").write_text(HARNESS)
    (tmp_path / "script.json").write_text(json.dumps(SCRIPT))
    (tmp_path / "tasks.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "task_id": task,
                    "prompt": f"case:{case}",
                    "workspace": {"dir": "src"},
                    "eval": {"command": "test -f out.txt"},
                }
            )
            + "\n"
            for task, case in CASES.items()
        )
    )
    cfg = LoopConfig(
        tasks=tmp_path / "tasks.jsonl",
        run_dir=tmp_path / "run",
        iterations=1,
        group_size=2,
        concurrency=6,
        model="tiny",
        script=tmp_path / "script.json",
        max_tokens=48,  # forced on every call: the long reply is cut
        harness=f"cmd:{sys.executable} harness.py {{prompt}} {{base_url}} {{index}}",
        on_length="mask",
    )
    [stats] = Loop(cfg).run()

    assert stats.session_ends == {"length": 2, "unparsed_tool_call": 2, "completed": 2}
    assert stats.end_rules == {"length:mask": 2, "unparsed_tool_call:zero": 2}
    loop_json = json.loads((tmp_path / "run" / "loop.json").read_text())[0]
    assert loop_json["session_ends"] == stats.session_ends and loop_json["end_rules"] == stats.end_rules
    # what the iteration trains on: the cut sessions left out, the malformed call's 1.0 now the failure reward
    it = tmp_path / "run" / "iter-0"
    rewards = read_rewards_table(it / "rewards.parquet", ["task_id", "reward", "end"]).to_pylist()
    assert sorted((r["task_id"], r["reward"], r["end"]) for r in rewards) == [
        ("broken", 1.0, "unparsed_tool_call"),
        ("broken", 1.0, "unparsed_tool_call"),
        ("fine", 1.0, "completed"),
        ("fine", 1.0, "completed"),
        ("long", 1.0, "length"),
        ("long", 1.0, "length"),
    ]
    merged = read_merged(it / "merged", columns=["task_id", "reward", "end"]).to_pylist()
    assert sorted((r["task_id"], r["reward"], r["end"]) for r in merged) == [
        ("broken", 0.0, "unparsed_tool_call"),
        ("broken", 0.0, "unparsed_tool_call"),
        ("fine", 1.0, "completed"),
        ("fine", 1.0, "completed"),
    ]
    cell = "2 length (2 mask) · 2 unparsed_tool_call (2 zero)"
    console = Console(record=True, width=400)
    console.print(iteration_table([stats]))
    assert cell in console.export_text()
    report = (tmp_path / "run" / "report.html").read_text()
    assert cell in report and report.count(">unparsed_tool_call<") == 2  # the sessions table's end column
