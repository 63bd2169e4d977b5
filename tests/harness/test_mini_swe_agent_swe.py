"""mini-swe-agent as a SWE-task harness: `polar-mitm rollout … --harness mini-swe-agent` on one offline instance
(examples/swe_tasks), graded like Codex is today.

The scripted tiny engine makes mini-swe-agent's `bash` tool apply the instance's gold patch, then submit; the
rollout clones the bundle, builds the task's venv, runs the harness through the gateway (proxy mode), grades with
swebench and must give reward 1.0. The fixtures and helpers are tests/rollout/test_swe_tasks.py's.
"""

from __future__ import annotations

import json

import pytest

from polar_mitm.harness import get_harness
from polar_mitm.harness.mini_swe_agent import SUBMIT_COMMAND
from polar_mitm.harness.policy import shell_script
from polar_mitm.storage.records import read_all
from tests.rollout.test_swe_tasks import INSTANCES, one_task_file, rollout_cli, swe_file  # noqa: F401

pytestmark = pytest.mark.slow


def test_mini_swe_agent_applies_the_gold_patch_and_scores_one_through_polar_mitm_rollout(
    swe_file,  # noqa: F811 — the shared fixture
    tmp_path,
    tiny_engine,
):
    get_harness("mini-swe-agent").executable()  # installed by scripts/setup-mini-swe-agent.sh, or this fails
    task_id = "inflection__pluralize-sh"
    gold = next(i for i in INSTANCES if i["instance_id"] == task_id)["patch"]
    script = tmp_path / "policy.json"
    apply_gold = f"git apply - <<'POLAR_PATCH_EOF'\n{gold}POLAR_PATCH_EOF"
    script.write_text(json.dumps(shell_script([apply_gold], "Fixed: words ending in 'sh' take 'es'.")))
    tasks = one_task_file(swe_file, task_id, tmp_path / "one.jsonl")
    [row] = rollout_cli(tasks, "mini-swe-agent", tmp_path, "-g", "1", "-c", "1", "--script", str(script))
    records = [r for r in read_all(tmp_path / "flows").to_pylist() if r["session_id"] == row["session_id"]]
    log = next((tmp_path / "run" / "logs").glob("*.log")).read_text(errors="replace")[-3000:]
    context = f"{row}\n--- harness log ---\n{log}"
    assert (row["status"], row["reward"]) == ("ok", 1.0), context
    assert "RESOLVED_FULL" in row["eval_output"]
    # Two model calls: the patch, then the submit command (which ends mini-swe-agent's run).
    assert [r["finish_reason"] for r in records] == ["tool_calls", "tool_calls"], context
    assert all(r["task_id"] == task_id and r["completion_ids"] and r["status_code"] == 200 for r in records)
    decoded = [tiny_engine.tokenizer.decode(r["completion_ids"]) for r in records]
    assert "git apply - <<'POLAR_PATCH_EOF'" in decoded[0] and SUBMIT_COMMAND in decoded[1]
