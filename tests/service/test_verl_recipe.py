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

from polar_mitm.service.task_requests import line_to_request

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "verl.md"
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
EXAMPLE_TASKS = ROOT / "examples" / "cpu_tasks" / "tasks.jsonl"
ENTRY = "verl.trainer.main_ppo"
OVERRIDE = re.compile(r"^\+?[A-Za-z_][\w.]*=")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

VERL_CHECK = """
import json, os, sys
import hydra
from hydra import compose, initialize_config_dir
import verl.trainer.config
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
from verl.utils.dataset.rl_dataset import RLHFDataset
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
    loop = hydra.utils.instantiate(  # as verl's AgentLoopWorker makes each agent loop (no engine, no tokenizer)
        config=_agent_loop_registry[rollout.agent.default_agent_loop],
        trainer_config=DictConfigWrap(config=config),
        server_manager=None,
        tokenizer=None,
        processor=None,
        hf_model_type=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
    )
    answer["setups"][name] = {
        "rollout_config": type(rollout) is RolloutConfig,
        "agent_loop": rollout.agent.default_agent_loop,
        "registered": rollout.agent.default_agent_loop in _agent_loop_registry,
        "mode": rollout.mode,
        "engine": rollout.name,
        "adv_estimator": config.algorithm.adv_estimator,
        "env_vars": dict(config.ray_kwargs.ray_init.runtime_env.get("env_vars") or {}),
        "custom": rollout.custom,
        "loop_settings": vars(loop.settings),
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


TASK_ROWS = """
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
from polar_mitm.service.verl_agent_loop import session_request

lines, parquet = json.loads(sys.argv[1]), sys.argv[2]
rows = [{"extra_info": {"index": i, "polar_task": line}} for i, line in enumerate(lines)]
pq.write_table(pa.Table.from_pylist(rows), parquet)  # one struct type for all the lines, as verl's datasets are
read_back = pq.read_table(parquet).to_pylist()
as_text = [{"extra_info": {"polar_task": json.dumps(line)}} for line in lines]
requests = [session_request(row, "claude-code").model_dump(mode="json") for row in read_back + as_text]
print("ANSWER " + json.dumps({"read_back": read_back, "requests": requests}))
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
        # The loop's settings ride in RolloutConfig's free-form `custom` (verl refuses keys of its own there), and
        # the loop verl makes from the config reads them; the token stays in the shell (verl prints its config).
        given = setup["custom"]["polar_mitm"]
        assert given == {"url": "http://127.0.0.1:8700", "harness": "claude-code"}, name
        assert {k: setup["loop_settings"][k] for k in given} == given, name
        assert "POLAR_SERVICE_TOKEN" not in setup["env_vars"] and "POLAR_SERVICE_TOKEN" not in json.dumps(
            given
        )
    assert answer["setups"]["setup-B"]["callback"] is True
    assert all(answer["refused"].values()), answer["refused"]
    expected = [
        json.loads(line)["task_id"] for line in EXAMPLE_TASKS.read_text().splitlines() if line.strip()
    ]
    assert answer["task_ids"] == expected


@pytest.mark.skipif(
    not VERL_PYTHON.exists(), reason="verl is not installed: run scripts/setup-verl.sh (.venv-verl)"
)
def test_task_lines_read_back_from_parquet_with_nones_for_the_keys_they_lack_are_the_same_tasks(tmp_path):
    """Parquet gives each line the keys of all (None where it had none): the loop's request is the line's own, as
    it is for the line's JSON text."""
    lines = [json.loads(text) for text in EXAMPLE_TASKS.read_text().splitlines() if text.strip()]
    lines[0]["meta"] = {"owner": "a", "tags": ["x"]}
    lines[1]["meta"] = {"tries": 2}
    done = subprocess.run(
        [str(VERL_PYTHON), "-c", TASK_ROWS, json.dumps(lines), str(tmp_path / "rows.parquet")],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.split("ANSWER ", 1)[1])
    read_back = [row["extra_info"]["polar_task"] for row in answer["read_back"]]
    assert read_back[0]["workspace"]["setup"] is None and read_back[0]["meta"]["tries"] is None
    assert read_back[1]["meta"]["owner"] is None and read_back[2]["meta"] is None
    expected = [line_to_request(line, "claude-code").model_dump(mode="json") for line in lines]
    for got in answer["requests"]:
        got["task_id"] = got["task_id"].rsplit("-", 1)[0]  # each call its own task: a fresh suffix
    assert answer["requests"] == expected + expected
