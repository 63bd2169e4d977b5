"""OpenHands as a SWE-task harness: `polar-mitm rollout … --harness openhands` on one offline instance
(examples/swe_tasks), graded like Codex is today.

The scripted tiny engine makes the OpenHands CLI's `terminal` tool apply the instance's gold patch, then answer; the
rollout clones the bundle, builds the task's venv, runs the harness through the gateway (proxy mode), grades with
swebench and must give reward 1.0. The fixtures and helpers are tests/rollout/test_swe_tasks.py's.
"""

from __future__ import annotations

import json

import pytest

from polar_mitm.harness import get_harness
from polar_mitm.harness.policy import shell_script
from polar_mitm.storage.records import read_all
from tests.rollout.test_swe_tasks import INSTANCES, one_task_file, rollout_cli, swe_file  # noqa: F401

pytestmark = pytest.mark.slow


def test_openhands_applies_the_gold_patch_and_scores_one_through_polar_mitm_rollout(
    swe_file,  # noqa: F811 — the shared fixture
    tmp_path,
    tiny_engine,
):
    get_harness("openhands").executable()  # installed by scripts/setup-openhands.sh, or this fails
    task_id = "inflection__pluralize-sh"
    gold = next(i for i in INSTANCES if i["instance_id"] == task_id)["patch"]
    script = tmp_path / "policy.json"
    apply_gold = f"git apply - <<'POLAR_PATCH_EOF'\n{gold}POLAR_PATCH_EOF"
    final = "Fixed: words ending in 'sh' take 'es'."
    script.write_text(json.dumps(shell_script([apply_gold], final)))
    tasks = one_task_file(swe_file, task_id, tmp_path / "one.jsonl")
    [row] = rollout_cli(tasks, "openhands", tmp_path, "-g", "1", "-c", "1", "--script", str(script))
    records = [r for r in read_all(tmp_path / "flows").to_pylist() if r["session_id"] == row["session_id"]]
    log = next((tmp_path / "run" / "logs").glob("*.log")).read_text(errors="replace")[-3000:]
    context = f"{row}\n--- harness log ---\n{log}"
    assert (row["status"], row["reward"]) == ("ok", 1.0), context
    assert "RESOLVED_FULL" in row["eval_output"]
    # Two model calls: the patch (through `terminal`), then the final answer, which ends the headless run.
    assert [r["finish_reason"] for r in records] == ["tool_calls", "stop"], context
    assert all(r["task_id"] == task_id and r["completion_ids"] and r["status_code"] == 200 for r in records)
    call = tiny_engine.tokenizer.decode(records[0]["completion_ids"])
    assert '"name": "terminal"' in call and "git apply - <<'POLAR_PATCH_EOF'" in call
    assert tiny_engine.tokenizer.decode(records[1]["completion_ids"], skip_special_tokens=True) == final
