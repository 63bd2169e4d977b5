"""GRPO on recorded rollouts: logprob alignment with the engine, weight updates, zero-variance groups, staleness
correction, the `grpo` / `plot` / `sync` commands, LoRA, and pushing new weights to a served engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines import processes as engine_processes
from polar_mitm.processes import children
from polar_mitm.storage.merged import MERGED_SCHEMA, MergedSequence
from polar_mitm.train.data import build_training_data
from polar_mitm.train.grpo_config import PolarGRPOConfig
from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

pytestmark = pytest.mark.slow

PROMPTS = ["Write hello into out.txt", "List the files here.", "What is 2 + 2?"]
TOOL_RESULT = "out.txt written"


def chat_prompt(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def generate(
    url: str, prompt_ids: list[int], *, seed: int, max_new_tokens: int = 12, temperature: float = 1.0
) -> tuple[list[int], list[float], str]:
    """SGLang-native /generate on the served engine: (sampled ids, their logprobs, weight_version)."""
    body = {
        "input_ids": prompt_ids,
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "sampling_seed": seed,
            "ignore_eos": True,
        },
    }
    answer = (
        httpx.post(f"{url}/generate", json=body, timeout=120, headers=engine_keys.auth_headers(url))
        .raise_for_status()
        .json()
    )
    meta = answer["meta_info"]
    logprobs = [entry[0] for entry in meta["output_token_logprobs"]]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == answer["output_ids"]
    return answer["output_ids"], logprobs, meta["weight_version"]


def served_rollouts(url: str, tokenizer, *, group_size: int = 3, seed: int = 0) -> list[MergedSequence]:
    """Real captured sequences: per task, `group_size` sessions; every other session has a second turn after a
    tool result, merged into one sequence (sampled, context, sampled) as prefix_merging builds them."""
    suffix = tokenizer.encode(
        f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{TOOL_RESULT}\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    sequences = []
    for t, text in enumerate(PROMPTS):
        prompt = chat_prompt(tokenizer, text)
        for g in range(group_size):
            s = seed * 1000 + t * 10 + g
            ids, logprobs, version = generate(url, prompt, seed=s)
            input_ids, mask, lps = (
                [*prompt, *ids],
                [0] * len(prompt) + [1] * len(ids),
                [0.0] * len(prompt) + logprobs,
            )
            if g % 2:
                more, more_lps, _ = generate(url, [*input_ids, *suffix], seed=s + 5, max_new_tokens=8)
                input_ids += [*suffix, *more]
                mask += [0] * len(suffix) + [1] * len(more)
                lps += [0.0] * len(suffix) + more_lps
            sequences.append(
                MergedSequence(
                    sequence_id=f"seq-{t}-{g}",
                    session_id=f"sess-{t}-{g}",
                    task_id=f"task-{t}",
                    input_ids=input_ids,
                    loss_mask=mask,
                    logprobs=lps,
                    prompt_len=len(prompt),
                    request_ids=[f"req-{t}-{g}"],
                    n_turns=1 + g % 2,
                    builder="prefix_merging",
                    weight_version_min=version,
                    weight_version_max=version,
                    reward=float((t + g) % 3) / 2,
                )
            )
    return sequences


def write_shard(sequences: list[MergedSequence], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist([s.to_row() for s in sequences], schema=MERGED_SCHEMA),
        directory / "part-0.parquet",
    )
    return directory


def make_trainer(
    model_dir: Path, rows_from: list[MergedSequence], out: Path, **overrides
) -> PolarGRPOTrainer:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=len(rows_from),
        max_steps=1,
        report_to=[],
        disable_tqdm=True,
        learning_rate=1e-2,
        seed=0,
    )
    settings.update(overrides)
    return PolarGRPOTrainer(
        str(model_dir), args=PolarGRPOConfig(**settings), train_data=build_training_data(rows_from)
    )


def recomputed_logps(trainer: PolarGRPOTrainer, rows: list[dict]) -> tuple[torch.Tensor, dict]:
    """TRL's own logprob path (the one the loss uses) on the batch our override builds."""
    batch = trainer._generate_and_score_completions(rows)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention, batch["completion_ids"].size(1)
        )
    return logps, batch


def run_cli(*args: str) -> None:
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(directory.glob("*.safetensors"))))


@pytest.fixture(scope="module")
def rollouts(engine_url, tiny_engine) -> list[MergedSequence]:
    return served_rollouts(engine_url, tiny_engine.tokenizer)


def test_step0_recomputed_logprobs_equal_the_engines_behaviour_logprobs(rollouts, tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, rollouts, tmp_path / "run", temperature=1.0)
    rows = trainer.train_data.rows
    assert len({r["prompt_len"] for r in rows}) > 1 and any(r["loss_mask"][-1] == 1 for r in rows)
    logps, batch = recomputed_logps(trainer, rows)
    mask = batch["tool_mask"].bool()
    assert int(mask.sum()) == sum(sum(r["loss_mask"]) for r in rows)  # every sampled token, nothing else
    recorded = batch["old_per_token_logps"]
    assert torch.isfinite(recorded).all() and float(recorded[~mask].abs().max()) == 0.0
    assert float((logps - recorded)[mask].abs().max()) <= 1e-3
    # The same check inside training: the metric the trainer logs at step 0.
    trainer.train()
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["logp_diff/fresh_max"] <= 1e-3 and first["staleness/max"] == 0


def test_a_mismatched_temperature_breaks_the_equality(rollouts, tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, rollouts, tmp_path / "run", temperature=0.7)
    logps, batch = recomputed_logps(trainer, trainer.train_data.rows)
    mask = batch["tool_mask"].bool()
    assert float((logps - batch["old_per_token_logps"])[mask].abs().max()) > 0.1


def test_stale_rollouts_are_anchored_on_current_logprobs_and_weighted_by_truncated_ratios(rollouts, tmp_path):
    from polar_mitm.engine.model_zoo import resolve_model

    other_weights = resolve_model("tiny", seed=1)  # the policy moved on since the engine sampled
    # The shared engine may have been updated by other tests: count three versions on from what it recorded.
    (sampled_version,) = {r.weight_version_min for r in rollouts}
    trainer = make_trainer(
        other_weights,
        rollouts,
        tmp_path / "run",
        policy_weight_version=str(int(sampled_version) + 3),
        stale_is_clip_max=1.2,
    )
    rows = trainer.train_data.rows
    assert {trainer.staleness(r["weight_version"]) for r in rows} == {3}
    current, batch = recomputed_logps(trainer, rows)
    mask = batch["tool_mask"].bool()
    behaviour = batch["sampling_per_token_logps"]
    assert torch.allclose(batch["old_per_token_logps"][mask], current[mask], atol=1e-5)
    raw = torch.exp(current - behaviour)
    expected = raw.clamp(max=1.2)
    base = torch.tensor([r["advantage"] for r in rows]).unsqueeze(1).expand_as(mask)
    assert batch["advantages"].shape == mask.shape
    weighted = mask & (base != 0)
    assert torch.allclose((batch["advantages"] / base)[weighted], expected[weighted], atol=1e-4)
    assert bool((raw[weighted] > 1.2).any())  # some were truncated

    plain = make_trainer(
        other_weights, rollouts, tmp_path / "plain", policy_weight_version="3", stale_correction="none"
    )
    _, batch = recomputed_logps(plain, plain.train_data.rows)
    assert torch.equal(batch["old_per_token_logps"], batch["sampling_per_token_logps"])
    assert batch["advantages"].dim() == 1


def test_zero_variance_groups_leave_every_parameter_unchanged(rollouts, tiny_model_dir, tmp_path):
    same_reward = [MergedSequence(**{**s.__dict__, "reward": 0.5}) for s in rollouts]
    trainer = make_trainer(tiny_model_dir, same_reward, tmp_path / "run", max_steps=2, learning_rate=0.1)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["advantages/frac_zero"] == 1.0 for r in logged if "loss" in r)
    # Control: the same data with its rewards does move the weights.
    moving = make_trainer(tiny_model_dir, rollouts, tmp_path / "control", learning_rate=0.1)
    moving.train()
    assert any(not torch.equal(before[k], v) for k, v in moving.model.state_dict().items())


def test_grpo_command_trains_writes_a_checkpoint_metrics_tensorboard_and_plots(
    rollouts, tiny_model_dir, tmp_path
):
    data = write_shard(rollouts, tmp_path / "merged")
    run = tmp_path / "runs" / "cli"
    run_cli(
        "grpo",
        "--data",
        str(data),
        "--model",
        str(tiny_model_dir),
        "--output-dir",
        str(run),
        "--max-steps",
        "3",
        "--learning-rate",
        "1e-2",
        "--per-device-batch-size",
        "3",
        "--gradient-accumulation-steps",
        "2",
        "--num-generations",
        "3",
        "--beta",
        "0.04",
        "--epsilon-high",
        "0.28",
        "--max-length",
        "40",
        "--advantage",
        "leave_one_out",
        "--temperature",
        "1.0",
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in (
        "loss",
        "reward",
        "reward_std",
        "advantages/mean",
        "advantages/std",
        "clip_ratio/region_mean",
        "kl",
        "staleness/mean",
        "tokens_per_second",
        "grad_norm",
    ):
        assert all(r.get(key) is not None and math.isfinite(r[key]) for r in steps), key
    assert any("importance_ratio/mean" in r for r in steps)  # from step 2 on, the rollouts are stale
    assert steps[0]["staleness/max"] == 0 and steps[-1]["staleness/max"] == 2
    assert list((run / "runs").rglob("events.out.tfevents.*"))
    trained, original = safetensors_of(run), safetensors_of(tiny_model_dir)
    assert set(trained) == set(original)
    assert any(not torch.equal(trained[k], original[k]) for k in original)
    assert (run / "polar_model.json").exists() and (run / "tokenizer.json").exists()
    stats = json.loads((run / "data_stats.json").read_text())
    assert stats["group_sizes"] == {"3": 3} and stats["truncated"] > 0
    run_cli("plot", str(run))
    assert (run / "plots" / "curves.png").stat().st_size > 10_000


def test_lora_writes_adapters_and_a_merged_model_the_engine_loads(rollouts, tiny_model_dir, tmp_path):
    from polar_mitm.engine.generation import Engine

    data = write_shard(rollouts, tmp_path / "merged")
    run = tmp_path / "lora"
    run_cli(
        "grpo",
        "--data",
        str(data),
        "--model",
        str(tiny_model_dir),
        "--output-dir",
        str(run),
        "--lora",
        "--lora-r",
        "4",
        "--max-steps",
        "2",
        "--learning-rate",
        "5e-2",
        "--per-device-batch-size",
        "9",
        "--report-to",
        "none",
    )
    assert (run / "adapter_config.json").exists() and (run / "adapter_model.safetensors").exists()
    merged, original = safetensors_of(run / "merged"), safetensors_of(tiny_model_dir)
    assert set(merged) == set(original)
    assert any(not torch.equal(merged[k], original[k]) for k in original)
    engine = Engine(run / "merged")
    assert engine.tool_call_parser == "qwen25"  # polar_model.json came along
    assert len(engine.score([1, 2, 3], [4, 5])) == 2


@pytest.fixture
def own_engine(tmp_path):
    """An engine of our own: this test changes its weights, the session's shared engine must keep its own."""
    proc, url = engine_processes.start_engine("tiny", log=tmp_path / "engine.log")
    yield url
    children.stop(proc)


def test_push_to_engine_changes_its_weight_version_and_outputs(
    own_engine, tiny_engine, tiny_model_dir, tmp_path
):
    prompt = chat_prompt(tiny_engine.tokenizer, PROMPTS[0])
    before_ids, _, before_version = generate(own_engine, prompt, seed=1, max_new_tokens=16, temperature=0.0)
    assert before_version == "0"
    data = write_shard(served_rollouts(own_engine, tiny_engine.tokenizer, seed=7), tmp_path / "merged")
    run = tmp_path / "push"
    run_cli(
        "grpo",
        "--data",
        str(data),
        "--model",
        str(tiny_model_dir),
        "--output-dir",
        str(run),
        "--max-steps",
        "2",
        "--learning-rate",
        "5e-2",
        "--per-device-batch-size",
        "9",
        "--report-to",
        "none",
        "--push-to-engine",
        own_engine,
    )
    info = httpx.get(
        f"{own_engine}/model_info", timeout=30, headers=engine_keys.auth_headers(own_engine)
    ).json()
    assert info["weight_version"] == "2"  # the data's version "0" plus two optimizer steps
    after_ids, _, after_version = generate(own_engine, prompt, seed=1, max_new_tokens=16, temperature=0.0)
    assert after_version == "2" and after_ids != before_ids
    # `polar-mitm sync` puts the original weights back, under a version of our choosing.
    run_cli("sync", "--engine", own_engine, "--model", str(tiny_model_dir), "--weight-version", "7")
    restored_ids, _, restored_version = generate(
        own_engine, prompt, seed=1, max_new_tokens=16, temperature=0.0
    )
    assert restored_version == "7" and restored_ids == before_ids
