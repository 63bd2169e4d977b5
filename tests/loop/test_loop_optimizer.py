"""One optimizer for a whole `polar-mitm loop` run: across three iterations the AdamW moments and step counts
continue, the LR schedule (with warmup) runs once over all of them, and with β > 0 the KL reference stays the initial
policy; with LoRA the adapter continues on the initial model; `--torch-dtype bf16` trains, writes and pushes bf16
weights the engine reloads.

The loop's own training stage (`Loop._train_stage`, exactly what `Loop.run` calls between merge and the next rollout)
is driven directly on recorded-style data scored by the current weights, so no harness has to run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from transformers import TrainerCallback

from polar_mitm.engine.generation import Engine
from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines import processes as engine_processes
from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.loop import Loop
from polar_mitm.storage.run_layout import RUN_STATE_DIR
from tests.train.scored_rows import task_groups, write_merged

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"
ITERATIONS = 3
WARMUP = 2
LEARNING_RATE = 1e-2


class OptimizerObserver(TrainerCallback):
    """The optimizer's state (AdamW moments and step counts) as each training starts and ends."""

    def __init__(self) -> None:
        self.begin: list[dict] = []
        self.end: list[dict] = []

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.begin.append(copy.deepcopy(optimizer.state_dict()["state"]))

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        self.end.append(copy.deepcopy(optimizer.state_dict()["state"]))


def make_loop(run_dir: Path, model_dir: Path, **grpo) -> Loop:
    cfg = LoopConfig(
        tasks=EXAMPLES / "tasks.jsonl",
        run_dir=run_dir.resolve(),
        iterations=ITERATIONS,
        learning_rate=LEARNING_RATE,
        per_device_batch_size=2,
        grpo=grpo,
    )
    loop = Loop(cfg, trainer_callbacks=[OptimizerObserver()])
    loop.model_dir = loop.initial_model_dir = model_dir
    return loop


def train_iteration(loop: Loop, k: int) -> None:
    """Iteration k's training on two task groups sampled (scored) by the weights the loop serves now."""
    sequences = task_groups(Engine(loop.model_dir), 2, prefix=f"it{k}-", weight_version=loop.weight_version)
    write_merged(sequences, loop.cfg.run_dir / f"iter-{k}" / "merged")
    trained = loop._train_stage(k)  # the training, then the push of its weights
    loop.model_dir = trained.model_dir
    loop.weight_version = trained.weight_version or loop.weight_version


def metrics(loop: Loop, k: int) -> list[dict]:
    path = loop.cfg.run_dir / f"iter-{k}" / "train" / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def three_iterations(tmp_path_factory, tiny_model_dir) -> Loop:
    torch.manual_seed(0)
    loop = make_loop(
        tmp_path_factory.mktemp("loop-optimizer") / "run",
        tiny_model_dir,
        lr_scheduler_type="linear",
        warmup_steps=WARMUP,
        beta=0.04,
    )
    for k in range(ITERATIONS):
        train_iteration(loop, k)
    return loop


def test_adam_moments_and_step_counts_continue_across_iterations(three_iterations):
    observer = three_iterations.trainer_callbacks[0]
    assert len(observer.begin) == len(observer.end) == ITERATIONS
    assert observer.begin[0] == {}  # the run's first training starts a fresh AdamW
    steps = [len(metrics(three_iterations, k)) for k in range(ITERATIONS)]
    assert all(steps)
    for k in range(1, ITERATIONS):
        before, now = observer.end[k - 1], observer.begin[k]
        assert now.keys() == before.keys() and now, k
        for index, state in now.items():
            for name in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(state[name], before[index][name]), (k, index, name)
    counts = {float(state["step"]) for state in observer.end[-1].values()}
    assert counts == {float(sum(steps))}  # one step count over the whole run


def test_the_lr_schedule_and_its_warmup_run_once_over_all_iterations(three_iterations):
    from transformers import get_scheduler

    logged = [
        (r["run_step"], r["learning_rate"]) for k in range(ITERATIONS) for r in metrics(three_iterations, k)
    ]
    # The schedule's horizon: the first iteration's length times the iterations (fixed by the first training).
    horizon = ITERATIONS * len(metrics(three_iterations, 0))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LEARNING_RATE)
    schedule = get_scheduler("linear", optimizer, num_warmup_steps=WARMUP, num_training_steps=horizon)
    expected = []
    for _ in range(len(logged)):
        expected.append(schedule.get_last_lr()[0])  # the LR each optimizer step uses
        optimizer.step()
        schedule.step()
    assert [step for step, _ in logged] == list(range(1, len(logged) + 1))
    assert [lr for _, lr in logged] == pytest.approx(expected, rel=1e-9)
    state = json.loads((three_iterations.cfg.run_dir / RUN_STATE_DIR / "run_state.json").read_text())
    assert (state["schedule_steps"], state["trainings"], state["optimizer_steps"]) == (
        horizon,
        3,
        len(logged),
    )


def test_with_beta_the_kl_reference_stays_the_initial_policy(three_iterations):
    # At an iteration's first step the policy is that iteration's starting weights: a reference reloaded from them
    # would give KL 0 there; the initial policy gives KL 0 only in the first iteration.
    first_kl = [metrics(three_iterations, k)[0]["kl"] for k in range(ITERATIONS)]
    assert first_kl[0] == pytest.approx(0.0, abs=1e-6)
    assert all(kl > 1e-3 for kl in first_kl[1:]), first_kl
    config = json.loads((three_iterations.cfg.run_dir / "iter-2" / "train" / "grpo_config.json").read_text())
    assert config["reference_model"] == str(three_iterations.initial_model_dir)


def test_an_iteration_whose_groups_are_all_flat_takes_no_optimizer_step(tmp_path, tiny_model_dir):
    """Equal rewards in every group: no policy gradient, so no training at all — AdamW's momentum alone would move
    the weights. The weights, the optimizer and the pushed version stay, the training still counts, and the next
    informative iteration continues the optimizer exactly where the last real training left it."""
    from polar_mitm.storage.run_layout import SKIPPED_TRAINING_FILE
    from polar_mitm.train.continuation import RunState

    loop = make_loop(tmp_path / "run", tiny_model_dir)
    train_iteration(loop, 0)
    state_dir = loop.cfg.run_dir / RUN_STATE_DIR
    optimizer_bytes, trained_dir, version = (
        (state_dir / "optimizer.pt").read_bytes(),
        loop.model_dir,
        loop.weight_version,
    )
    steps = RunState.load(state_dir).optimizer_steps
    flat = [
        dataclasses.replace(s, reward=1.0)
        for s in task_groups(Engine(loop.model_dir), 2, prefix="it1-", weight_version=version)
    ]
    write_merged(flat, loop.cfg.run_dir / "iter-1" / "merged")
    trained = loop._train_stage(1)
    assert (trained.model_dir, trained.weight_version, trained.skipped) == (trained_dir, version, True)
    observer, train = loop.trainer_callbacks[0], loop.cfg.run_dir / "iter-1" / "train"
    assert len(observer.begin) == 1 and not (train / "metrics.jsonl").exists()  # no trainer was even built
    assert json.loads((train / SKIPPED_TRAINING_FILE).read_text())["sequences"] == 4
    assert (state_dir / "optimizer.pt").read_bytes() == optimizer_bytes
    assert (RunState.load(state_dir).trainings, RunState.load(state_dir).optimizer_steps) == (2, steps)
    assert loop._training(1).skipped() is not None and RunState.load(state_dir).trainings == 2  # counted once
    train_iteration(loop, 2)
    assert len(observer.begin) == 2 and metrics(loop, 2)
    for index, moments in observer.begin[1].items():
        assert torch.equal(moments["exp_avg"], observer.end[0][index]["exp_avg"]), index
    assert RunState.load(state_dir).trainings == 3 and loop.weight_version != version


def test_keep_zero_advantage_groups_trains_a_flat_iteration_anyway(tmp_path, tiny_model_dir):
    loop = make_loop(tmp_path / "run", tiny_model_dir, keep_zero_advantage_groups=True)
    flat = [dataclasses.replace(s, reward=0.0) for s in task_groups(Engine(loop.model_dir), 2, prefix="it0-")]
    write_merged(flat, loop.cfg.run_dir / "iter-0" / "merged")
    trained = loop._train_stage(0)
    assert metrics(loop, 0) and trained.weight_version != "0" and not trained.skipped


class AdapterObserver(TrainerCallback):
    """The LoRA B matrices (zero in a fresh adapter) as each training starts and ends."""

    def __init__(self) -> None:
        self.begin: list[dict] = []
        self.end: list[dict] = []

    @staticmethod
    def lora_b(model) -> dict:
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.begin.append(self.lora_b(model))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.end.append(self.lora_b(model))


def test_with_lora_the_adapter_and_its_optimizer_continue_on_the_initial_model(tmp_path, tiny_model_dir):
    loop = make_loop(tmp_path / "run", tiny_model_dir, beta=0.04)
    loop.cfg.lora = True
    adapters = AdapterObserver()
    loop.trainer_callbacks.append(adapters)
    for k in range(2):
        train_iteration(loop, k)
    optimizer = loop.trainer_callbacks[0]
    assert all(float(b.abs().sum()) == 0.0 for b in adapters.begin[0].values())  # a fresh adapter at first
    assert adapters.begin[1].keys() == adapters.end[0].keys() and adapters.end[0]
    for name, trained in adapters.end[0].items():
        assert torch.equal(adapters.begin[1][name], trained) and float(trained.abs().sum()) > 0, name
    assert optimizer.begin[1] and all(
        torch.equal(state["exp_avg"], optimizer.end[0][index]["exp_avg"])
        for index, state in optimizer.begin[1].items()
    )
    assert (
        metrics(loop, 1)[0]["kl"] > 1e-4
    )  # the reference is the base: the initial model, not the merged start


def dtypes_of(directory: Path) -> set[torch.dtype]:
    with safe_open(directory / "model.safetensors", framework="pt") as weights:
        return {weights.get_tensor(name).dtype for name in weights.keys()}


def test_torch_dtype_bf16_trains_writes_and_pushes_bf16_weights_the_engine_reloads(tmp_path, tiny_model_dir):
    with engine_processes.engine_running(model="tiny", log=tmp_path / "engine.log") as url:
        loop = make_loop(tmp_path / "run", tiny_model_dir, torch_dtype="bf16")
        loop.engine_url = url
        train_iteration(loop, 0)
        train = loop.cfg.run_dir / "iter-0" / "train"
        pushed = train / "engine-weights"
        assert dtypes_of(train) == {torch.bfloat16} and dtypes_of(pushed) == {torch.bfloat16}
        assert json.loads((pushed / "config.json").read_text())["dtype"] == "bfloat16"
        assert (
            httpx.get(f"{url}/model_info", headers=engine_keys.auth_headers(url)).json()["weight_version"]
            == loop.weight_version
            != "0"
        )
        reloaded, initial = Engine(pushed), Engine(tiny_model_dir)
        prompt = initial.tokenizer.encode("Write hello into out.txt")
        answer = httpx.post(
            f"{url}/generate",
            headers=engine_keys.auth_headers(url),
            json={
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {
                    "max_new_tokens": 6,
                    "temperature": 1.0,
                    "sampling_seed": 3,
                    "ignore_eos": True,
                },
            },
            timeout=120,
        ).json()
    engine_logprobs = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
    ids = answer["output_ids"]
    # The engine now scores as the pushed bf16 checkpoint does (loaded by the same engine code), not as before.
    assert engine_logprobs == pytest.approx(reloaded.score(prompt, ids, temperature=1.0), abs=1e-5)
    before = initial.score(prompt, ids, temperature=1.0)
    assert max(abs(a - b) for a, b in zip(engine_logprobs, before, strict=True)) > 1e-3
