"""mini-swe-agent and OpenHands as SWE-task harnesses: `polar-mitm rollout … --harness NAME` on one offline instance
(examples/swe_tasks), graded like Codex is today.

The scripted tiny engine makes the harness's shell tool (mini-swe-agent's `bash`, the OpenHands CLI's `terminal`)
apply the instance's gold patch, then end the run — mini-swe-agent by its submit command, OpenHands by a final
answer; the rollout clones the bundle, builds the task's venv, runs the harness through the gateway (proxy mode),
grades with swebench and must give reward 1.0, every sampled token trained in the exact context it was sampled in
(the session runs in the default bwrap sandbox). The fixtures and helpers are tests/tasks/test_swe_tasks.py's.
"""

from __future__ import annotations

import json

import pytest

from polar_mitm.harness import get_harness
from polar_mitm.harness.mini_swe_agent import SUBMIT_COMMAND
from polar_mitm.harness.policy import shell_script
from polar_mitm.storage.records import read_all
from tests.harness.test_harnesses import fidelity
from tests.tasks.test_swe_tasks import INSTANCES, one_task_file, rollout_cli, swe_file  # noqa: F401

pytestmark = pytest.mark.slow

TASK_ID = "inflection__pluralize-sh"
FINAL = "Fixed: words ending in 'sh' take 'es'."
# Each harness's two model calls: the patch, then what ends its run (the submit command, or the final answer).
FINISH_REASONS = {"mini-swe-agent": ["tool_calls", "tool_calls"], "openhands": ["tool_calls", "stop"]}


@pytest.mark.parametrize("name", sorted(FINISH_REASONS))
def test_harness_applies_the_gold_patch_and_scores_one_through_polar_mitm_rollout(
    name,
    swe_file,  # noqa: F811 — the shared fixture
    tmp_path,
    tiny_engine,
):
    get_harness(name).executable()  # installed by scripts/setup-<name>.sh, or this fails
    gold = next(i for i in INSTANCES if i["instance_id"] == TASK_ID)["patch"]
    script = tmp_path / "policy.json"
    apply_gold = f"git apply - <<'POLAR_PATCH_EOF'\n{gold}POLAR_PATCH_EOF"
    script.write_text(json.dumps(shell_script([apply_gold], FINAL)))
    tasks = one_task_file(swe_file, TASK_ID, tmp_path / "one.jsonl")
    [row] = rollout_cli(tasks, name, tmp_path, "-g", "1", "-c", "1", "--script", str(script))
    records = [r for r in read_all(tmp_path / "flows").to_pylist() if r["session_id"] == row["session_id"]]
    log = next((tmp_path / "run" / "logs").glob("*.log")).read_text(errors="replace")[-3000:]
    context = f"{row}\n--- harness log ---\n{log}"
    assert (row["status"], row["reward"]) == ("ok", 1.0), context
    assert "RESOLVED_FULL" in row["eval_output"]
    assert [r["finish_reason"] for r in records] == FINISH_REASONS[name], context
    assert all(r["task_id"] == TASK_ID and r["completion_ids"] and r["status_code"] == 200 for r in records)
    decoded = [tiny_engine.tokenizer.decode(r["completion_ids"]) for r in records]
    assert "git apply - <<'POLAR_PATCH_EOF'" in decoded[0]
    if name == "mini-swe-agent":
        assert SUBMIT_COMMAND in decoded[1]
    else:
        assert '"name": "terminal"' in decoded[0]
        assert tiny_engine.tokenizer.decode(records[1]["completion_ids"], skip_special_tokens=True) == FINAL
    result = fidelity(records, tiny_engine)  # in the default bwrap sandbox, as the other 11 in tests/sandbox
    assert result["exact"] == result["sampled"] > 0, result
