"""The trainer's batches on the tiny model (issue 24 items 1-3): packed, padded and single-row forwards give the same
per-token logprobs, a packed micro-batch the padded loss and gradients; every optimizer step of a real run holds
whole groups with a zero mean advantage and no padding; a zero-advantage group changes neither the gradient nor the
loss normaliser (unless kept, when it shrinks the update by its share of the tokens).

Rows are random token ids scored in-process by the same tiny model (exact behaviour logprobs, two turns at
different temperatures), so every ratio is 1 and the comparisons are about layout alone."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import pytest
import torch

from polar_mitm.storage.merged import MergedSequence
from polar_mitm.train.batching import plan_micro_batches
from polar_mitm.train.data import build_training_data
from polar_mitm.train.grpo_config import PolarGRPOConfig
from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

pytestmark = pytest.mark.slow

LOGP_TOL = 1e-5


def scored_sequence(
    engine, task: str, session: str, reward: float, length: int, *, seed: int, temperatures=(0.7, 1.3)
) -> MergedSequence:
    """A prompt, a first sampled turn at temperatures[0], a context, a second turn at temperatures[1]; `length`
    tokens, the sampled ones scored by the engine at their turn's temperature."""
    rng = random.Random(seed)
    prompt, context = max(2, length // 4), max(1, length // 8)
    first = max(1, (length - prompt - context) // 2)
    second = length - prompt - context - first
    ids = [rng.randrange(1000, 20000) for _ in range(length)]
    turn2 = prompt + first + context
    logprobs = [0.0] * length
    logprobs[prompt : prompt + first] = engine.score(
        ids[:prompt], ids[prompt : prompt + first], temperatures[0]
    )
    logprobs[turn2:] = engine.score(ids[:turn2], ids[turn2:], temperatures[1])
    mask = [0] * prompt + [1] * first + [0] * context + [1] * second
    n = 2
    return MergedSequence(
        sequence_id=f"{session}:0",
        session_id=session,
        task_id=task,
        input_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        prompt_len=prompt,
        request_ids=[f"{session}-r{k}" for k in range(n)],
        n_turns=n,
        builder="prefix_merging",
        weight_version_min="0",
        weight_version_max="0",
        reward=reward,
        turn_starts=[prompt, turn2],
        turn_temperature=list(temperatures),
        turn_top_p=[1.0] * n,
        turn_top_k=[-1] * n,
        turn_min_p=[0.0] * n,
        turn_greedy=[False] * n,
    )


def failing_run_longer(engine, tasks: int, *, flat: int = 0, prefix: str = "t") -> list[MergedSequence]:
    """`tasks` groups of 4 sessions whose failures are 3× longer than their passes, then `flat` groups that all pass."""
    sequences = []
    for t in range(tasks + flat):
        base = 12 + 5 * t
        for g in range(4):
            passed = t >= tasks or g % 2 == 0
            length = base * (1 if passed else 3) + g
            seed = zlib.crc32(f"{prefix}{t}-{g}".encode())
            sequences.append(
                scored_sequence(engine, f"{prefix}{t}", f"{prefix}{t}-{g}", float(passed), length, seed=seed)
            )
    return sequences


def trainer_for(model_dir: Path, sequences: list[MergedSequence], out: Path, **overrides) -> PolarGRPOTrainer:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=-1,
        num_train_epochs=1,
        report_to=[],
        disable_tqdm=True,
        learning_rate=1e-2,
        seed=0,
    )
    settings.update(overrides)
    return PolarGRPOTrainer(
        str(model_dir), args=PolarGRPOConfig(**settings), train_data=build_training_data(sequences)
    )


def steps_logged(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def groups(tiny_engine) -> list[MergedSequence]:
    return failing_run_longer(tiny_engine, tasks=3)


def test_packed_padded_and_single_row_forwards_give_the_same_per_token_logprobs(
    groups, tiny_model_dir, tmp_path
):
    trainer = trainer_for(tiny_model_dir, groups, tmp_path / "run")
    rows = trainer.train_data.rows
    batch = {k: v.to(trainer.accelerator.device) for k, v in trainer._collate(rows).items()}
    prompt_lens = [r["prompt_len"] for r in rows]
    mask = batch["loss_mask"].bool()
    recorded = batch["behaviour_logps"]
    by_layout = {}
    for packed in (True, False):
        _, plan = plan_micro_batches(rows, len(rows), 3, packed=packed)
        with torch.no_grad():
            by_layout[packed] = trainer._planned_logps(batch, plan, prompt_lens, trainer._policy_forward)
    split = batch["prompt_ids"].size(1)
    for i, row in enumerate(rows):  # each row alone: no padding, no other sequence
        alone = trainer._collate([row])
        logps = trainer.policy_logps({k: v.to(recorded.device) for k, v in alone.items()})[0]
        offset = alone["prompt_ids"].size(1) - split
        for layout in (True, False):
            got = by_layout[layout][i, offset : offset + logps.size(0)]
            keep = alone["loss_mask"][0].bool()
            assert float((got[keep] - logps[keep]).abs().max()) <= LOGP_TOL, (layout, i)
    for layout in (True, False):  # and the engine's own scores, each turn at its temperature
        assert float((by_layout[layout] - recorded)[mask].abs().max()) <= LOGP_TOL
    assert len({len(r["input_ids"]) for r in rows}) > 4 and len({r["prompt_len"] for r in rows}) > 2


def step_loss_and_gradients(trainer: PolarGRPOTrainer) -> tuple[float, dict, list]:
    """One optimizer step's loss and gradients as the training loop computes them: the generation batch scored,
    cut into its micro-batches, each micro-batch's loss back-propagated."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by the loop
    micro = trainer._split_micro_batches(trainer._generate_and_score_completions(trainer.train_data.rows))
    trainer.model.zero_grad()
    total = sum(trainer.compute_loss(trainer.model, m) for m in micro)
    total.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return total.item(), grads, [m["completion_ids"].shape for m in micro]


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_a_packed_micro_batch_gives_the_padded_loss_and_gradients(
    groups, tiny_model_dir, tmp_path, loss_type
):
    # bnpo averages each micro-batch's tokens: packed (balanced by tokens) and padded (by padded grid) micro-batches
    # hold different rows, so only the step's normaliser makes the two agree. Activation checkpointing recomputes
    # each layer in the backward, where a packed row must still be attended per sequence.
    runs = {}
    for name, options in (
        ("padded", {"batch_layout": "padded"}),
        ("packed", {"batch_layout": "packed"}),
        ("packed+checkpointing", {"batch_layout": "packed", "activation_checkpointing": True}),
    ):
        trainer = trainer_for(
            tiny_model_dir,
            groups,
            tmp_path / name,
            per_device_train_batch_size=3,
            beta=0.04,
            loss_type=loss_type,
            gradient_accumulation_steps=4,
            **options,
        )
        assert trainer.packs_micro_batches() == name.startswith("packed")
        runs[name] = step_loss_and_gradients(trainer)
    padded_loss, padded_grads, padded_shapes = runs.pop("padded")
    assert any(shape[0] > 1 for shape in padded_shapes)
    norm = max(float(g.abs().max()) for g in padded_grads.values())
    assert norm > 0
    for name, (loss, grads, shapes) in runs.items():
        assert all(shape[0] == 1 for shape in shapes), name
        assert loss == pytest.approx(padded_loss, rel=1e-5, abs=1e-7), name
        for param, grad in padded_grads.items():
            assert float((grads[param] - grad).abs().max()) <= 1e-4 * norm, (name, param)


def test_per_sequence_losses_weigh_every_row_alike_however_the_micro_batches_fall(
    groups, tiny_model_dir, tmp_path
):
    # grpo averages each sequence, then the rows of a micro-batch: micro-batches of 1 to 3 rows would weigh a row by
    # its micro-batch. The step's gradient equals that of the mean over all its rows computed as one batch.
    trainer = trainer_for(
        tiny_model_dir,
        groups,
        tmp_path / "run",
        loss_type="grpo",
        per_device_train_batch_size=3,
        gradient_accumulation_steps=4,
    )
    _, step_grads, shapes = step_loss_and_gradients(trainer)
    assert len({shape[0] for shape in shapes}) > 1  # the micro-batches hold different numbers of rows
    trainer.model.eval()
    trainer.model.zero_grad()
    trainer.compute_loss(
        trainer.model, trainer._generate_and_score_completions(trainer.train_data.rows)
    ).backward()
    norm = max(float(p.grad.abs().max()) for p in trainer.model.parameters() if p.grad is not None)
    assert norm > 0
    for name, param in trainer.model.named_parameters():
        if param.grad is not None:
            assert float((step_grads[name] - param.grad).abs().max()) <= 1e-4 * norm, name


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_every_optimizer_step_of_a_run_holds_whole_groups_with_a_zero_mean_advantage(
    tiny_engine, tiny_model_dir, tmp_path, layout
):
    # 6 groups of 4 (failures 3x longer), 8 rows per step: whole groups give 2 groups a step, each with mean 0.
    sequences = failing_run_longer(tiny_engine, tasks=6, prefix=layout)
    trainer = trainer_for(tiny_model_dir, sequences, tmp_path / "run", batch_layout=layout)
    trainer.train()
    steps = steps_logged(tmp_path / "run")
    assert len(steps) == 3
    for step in steps:
        assert abs(step["advantages/mean"]) <= 1e-6
        assert step["batch/groups"] == 2 and step["batch/rows"] == 8
        assert step["padding_fraction"] == 0.0 if layout == "packed" else step["padding_fraction"] < 0.25
    assert sum(s["batch/tokens"] for s in steps) == sum(len(s.input_ids) for s in sequences)


def test_a_zero_advantage_group_changes_neither_the_gradient_nor_the_normaliser(
    tiny_engine, groups, tiny_model_dir, tmp_path
):
    flat = failing_run_longer(tiny_engine, tasks=0, flat=1, prefix="flat")  # 4 sessions, all passed
    runs = {}
    for name, data, keep in (
        ("informative", groups, False),
        ("with-flat", groups + flat, False),
        ("kept", groups + flat, True),
    ):
        trainer = trainer_for(
            tiny_model_dir,
            data,
            tmp_path / name,
            per_device_train_batch_size=len(groups + flat),
            gradient_accumulation_steps=1,
            max_steps=1,
            keep_zero_advantage_groups=keep,
        )
        trainer.train()
        (step,) = steps_logged(tmp_path / name)
        runs[name] = (step["grad_norm"], step["batch/loss_tokens"], trainer.train_data.stats)
    (base_norm, base_tokens, _), (norm, tokens, stats), (kept_norm, kept_tokens, kept_stats) = runs.values()
    assert tokens == base_tokens and norm == pytest.approx(base_norm, rel=1e-5)
    assert (stats.zero_advantage_groups, stats.zero_advantage_sequences) == (
        1,
        4,
    ) and not stats.zero_advantage_kept
    # Kept, its tokens join the normaliser and every other token's gradient shrinks by their share.
    flat_tokens = sum(sum(s.loss_mask) for s in flat)
    assert kept_tokens == base_tokens + flat_tokens and kept_stats.zero_advantage_kept
    assert kept_norm == pytest.approx(base_norm * base_tokens / kept_tokens, rel=1e-4)
