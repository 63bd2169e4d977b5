"""Harbor tasks through the real rollout runner (issue 41 §2): each session in its bwrap sandbox with the task's
workspace at its workdir, the verifier's tests placed at /tests only once the agent is done, the reward read from
the session's own /logs. An oracle agent (the task's solve.sh, carried in its workspace and removed before it runs)
scores full marks on every example task, a no-op agent scores nothing; with --sandbox none a Harbor task is refused
before any session starts.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig
from polar_mitm.sandbox import SandboxUnavailable
from polar_mitm.tasks.harbor import ConvertOptions, convert
from polar_mitm.tasks.task_file import load_tasks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "harbor_tasks"
ORACLE = ".oracle-solve.sh"
ORACLE_AGENT = f"cmd:cp {ORACLE} /tmp/solve.sh && rm {ORACLE} && bash /tmp/solve.sh"


def harbor_tasks(tmp_path: Path, *, with_oracle: bool) -> Path:
    out = tmp_path / "tasks.jsonl"
    lines, _ = convert([EXAMPLES], out, ConvertOptions())
    if with_oracle:
        for line in lines:
            workspace = out.parent / line["workspace"]["dir"]
            solution = out.parent / line["eval"]["harbor"]["solution"] / "solve.sh"
            shutil.copy(solution, workspace / ORACLE)
    return out


def rewards(tasks: Path, harness: str, tmp_path: Path, **config) -> dict[str, tuple[str, float]]:
    rollout = Rollout(
        load_tasks(tasks),
        HarnessSpec(harness),
        GatewayEndpoints("http://127.0.0.1:9"),  # these agents call no model
        RolloutConfig(
            group_size=1, concurrency=4, workspace_root=tmp_path / "ws", log_dir=tmp_path / "logs", **config
        ),
    )
    summary = asyncio.run(rollout.run())
    return {s.task.task_id: (s.status, s.reward, s.eval_output) for s in summary.sessions}


def test_an_oracle_agent_scores_full_marks_and_a_no_op_nothing_on_every_example(tmp_path):
    oracle = rewards(harbor_tasks(tmp_path / "o", with_oracle=True), ORACLE_AGENT, tmp_path / "o")
    assert len(oracle) >= 8
    assert {task: r[:2] for task, r in oracle.items()} == {task: ("ok", 1.0) for task in oracle}, oracle
    no_op = rewards(harbor_tasks(tmp_path / "n", with_oracle=False), "cmd:true", tmp_path / "n")
    assert all(reward == 0.0 for _, reward, _ in no_op.values()), no_op
    assert not list((tmp_path / "o" / "ws").iterdir())  # workspaces and grading folders gone after teardown


def test_a_harbor_task_is_refused_without_a_sandbox(tmp_path):
    with pytest.raises(SandboxUnavailable, match="Harbor task"):
        rewards(harbor_tasks(tmp_path, with_oracle=False), "cmd:true", tmp_path, sandbox="none")
