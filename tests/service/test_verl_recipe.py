"""recipes/verl.md's GPU commands are verl's own config: every override composes with verl 0.9's Hydra config in
strict mode, and the result passes verl's checks (`validate_config`, the `RolloutConfig` dataclass its
`AgentLoopWorker` builds), names our agent loop, and finds it registered where verl imports `external_lib`.

verl is only in `.venv-verl` (scripts/setup-verl.sh), so the checks run there, in one subprocess; the recipe is
parsed here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "verl.md"
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
EXAMPLE_TASKS = ROOT / "examples" / "cpu_tasks" / "tasks.jsonl"
ENTRY = "verl.trainer.main_ppo"
OVERRIDE = re.compile(r"^\+?[A-Za-z_][\w.]*=")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

VERL_CHECK = """
import json, os, sys
from hydra import compose, initialize_config_dir
import verl.trainer.config
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.trainer.ppo.checkpoint_callback import CheckpointCallback
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.utils.import_utils import import_external_libs, load_class_from_fqn
from verl.workers.config import RolloutConfig

setups, refused, dataset_snippet, tasks = json.loads(sys.argv[1])
config_dir = os.path.dirname(verl.trainer.config.__file__)


def composed(overrides):
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


answer = {"setups": {}, "refused": {}}
for name, overrides in setups.items():
    config = composed(overrides)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)  # as verl's AgentLoopWorker does
    import_external_libs(config.actor_rollout_ref.model.external_lib)
    callback = config.trainer.checkpoint_callback_class
    answer["setups"][name] = {
        "rollout_config": type(rollout) is RolloutConfig,
        "agent_loop": rollout.agent.default_agent_loop,
        "registered": rollout.agent.default_agent_loop in _agent_loop_registry,
        "mode": rollout.mode,
        "engine": rollout.name,
        "adv_estimator": config.algorithm.adv_estimator,
        "env_vars": dict(config.ray_kwargs.ray_init.runtime_env.get("env_vars") or {}),
        "callback": callback and issubclass(load_class_from_fqn(callback, "CheckpointCallback"), CheckpointCallback),
    }
for name, overrides in refused.items():
    try:
        omega_conf_to_dataclass(composed(overrides).actor_rollout_ref.rollout)
    except Exception as exc:
        answer["refused"][name] = type(exc).__name__
    else:
        answer["refused"][name] = None

import pyarrow.parquet as pq
from polar_mitm.service.verl_agent_loop import session_request

exec(dataset_snippet, {})
answer["task_ids"] = [
    session_request(row, "claude-code").task_id.rsplit("-", 1)[0] for row in pq.read_table(tasks).to_pylist()
]
print("ANSWER " + json.dumps(answer))
"""


def fenced_blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def main_ppo_overrides(block: str) -> list[str]:
    """The Hydra overrides of the block's `python -m verl.trainer.main_ppo` command (continuations joined, up to
    the first word that is not an override: a redirection, a pipe, `&`)."""
    [command] = [line for line in block.replace("\\\n", " ").splitlines() if ENTRY in line]
    words = shlex.split(command, comments=True)
    overrides = []
    for word in words[words.index(ENTRY) + 1 :]:
        if not OVERRIDE.match(word):
            break
        overrides.append(word)
    return overrides


def recipe_setups() -> dict[str, list[str]]:
    blocks = [block for block in fenced_blocks(RECIPE.read_text(), "bash") if ENTRY in block]
    return {f"setup-{chr(ord('A') + i)}": main_ppo_overrides(block) for i, block in enumerate(blocks)}


@pytest.mark.skipif(
    not VERL_PYTHON.exists(), reason="verl is not installed: run scripts/setup-verl.sh (.venv-verl)"
)
def test_verl_recipe_commands_compose_with_verls_own_config(tmp_path):
    setups = recipe_setups()
    assert len(setups) == 2, "recipes/verl.md has one main_ppo command per engine setup (A: verl's, B: ours)"
    for overrides in setups.values():
        assert len(overrides) > 20 and all(OVERRIDE.match(word) for word in overrides)
    # The snippets the commands name: the checkpoint callback's module, and the dataset writer (on a copy of the
    # example task file, written where this test can read it back).
    [callback_snippet] = [b for b in fenced_blocks(RECIPE.read_text(), "python") if "CheckpointCallback" in b]
    (tmp_path / "polar_push.py").write_text(callback_snippet)
    [dataset_snippet] = [b for b in fenced_blocks(RECIPE.read_text(), "python") if "to_parquet" in b]
    parquet = tmp_path / "tasks.parquet"
    shutil.copy(EXAMPLE_TASKS, tmp_path / "tasks.jsonl")
    dataset_snippet = dataset_snippet.replace("/data/polar/tasks.parquet", str(parquet))
    setup_a = setups["setup-A"]
    refused = {  # what the checks must catch, so a passing run means something
        "misspelt key": [*setup_a, "actor_rollout_ref.rollout.agent.default_agent_lop=polar_mitm"],
        "settings under rollout": [
            *setup_a,
            "+actor_rollout_ref.rollout.polar_mitm.url=http://rollouts:8700",
        ],
    }
    done = subprocess.run(
        [str(VERL_PYTHON), "-c", VERL_CHECK, json.dumps([setups, refused, dataset_snippet, str(parquet)])],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # the snippets' relative paths (tasks.jsonl), and polar_push on the path
        env={**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"},
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.split("ANSWER ", 1)[1])
    for name, setup in answer["setups"].items():
        assert setup["rollout_config"] and setup["registered"], name
        assert (setup["agent_loop"], setup["mode"], setup["adv_estimator"]) == (
            "polar_mitm",
            "async",
            "grpo",
        ), name
        assert setup["engine"] in ("vllm", "sglang"), name
        assert setup["env_vars"].keys() >= {"POLAR_SERVICE_URL", "POLAR_HARNESS"}, name
        assert "POLAR_SERVICE_TOKEN" not in setup["env_vars"], (
            name
        )  # printed by verl's ray init: stays in the shell
    assert answer["setups"]["setup-B"]["callback"] is True
    assert all(answer["refused"].values()), answer["refused"]
    expected = [
        json.loads(line)["task_id"] for line in EXAMPLE_TASKS.read_text().splitlines() if line.strip()
    ]
    assert answer["task_ids"] == expected
