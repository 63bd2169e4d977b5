"""Off-policy bounds on both sides: a fresh row's ratio against the engine's logprobs is capped (`delta`, on by
default, counted), CISPO gets its own weight cap, `dr_grpo` normalises by rows × the completion budget, TRL options
that would do nothing on recorded rows are refused, and the straggler cut is counted per iteration."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from polar_mitm.loop.figures import cut_sessions
from polar_mitm.rollout.runner import RolloutSummary, SessionRun
from polar_mitm.tasks.task_file import load_tasks
from polar_mitm.train.data import build_training_data
from polar_mitm.train.grpo_config import CISPO_EPSILON_HIGH, FRESH_RATIO_CAP, PolarGRPOConfig
from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
from tests.train.scored_rows import scored_sequence, task_groups

pytestmark = pytest.mark.slow

GAP = 3.0  # nats by which the trainer's logprob exceeds the engine's recorded one
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"


def make_trainer(model_dir: Path, sequences, out: Path, **overrides) -> PolarGRPOTrainer:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        disable_tqdm=True,
        learning_rate=1e-2,
        seed=0,
    )
    settings.update(overrides)
    return PolarGRPOTrainer(
        str(model_dir), args=PolarGRPOConfig(**settings), train_data=build_training_data(sequences)
    )


def logged(trainer: PolarGRPOTrainer, name: str) -> list[float]:
    """A metric as the trainer collected it so far (outside `train()` the model is in eval mode)."""
    return trainer._metrics["train" if trainer.model.training else "eval"][name]


def row_gradient_norm(trainer: PolarGRPOTrainer, session_id: str) -> float:
    """The norm of the loss gradient from one row alone (its group's advantage, as scored for training)."""
    row = next(r for r in trainer.train_data.rows if r["session_id"] == session_id)
    batch = trainer._generate_and_score_completions([row])
    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, batch).backward()
    return float(torch.sqrt(sum((p.grad**2).sum() for p in trainer.model.parameters() if p.grad is not None)))


def test_a_row_with_a_3_nat_engine_trainer_gap_gets_a_bounded_weight(tiny_engine, tiny_model_dir, tmp_path):
    # A group of two; the failed session (negative advantage) was recorded GAP nats below what the trainer computes,
    # so its ratio is e^3 ≈ 20 and PPO's min takes the unclipped term.
    failed = dict(task="task", session="failed", answer="Sure, writing it now.", reward=0.0)
    passed = scored_sequence(tiny_engine, "task", "passed", "Done.", reward=1.0)
    exact = [scored_sequence(tiny_engine, **failed), passed]
    gapped = [scored_sequence(tiny_engine, **failed, logprob_shift=-GAP), passed]

    on_policy = row_gradient_norm(make_trainer(tiny_model_dir, exact, tmp_path / "exact"), "failed")
    uncapped = row_gradient_norm(
        make_trainer(tiny_model_dir, gapped, tmp_path / "off", delta=math.inf), "failed"
    )
    capped_trainer = make_trainer(tiny_model_dir, gapped, tmp_path / "capped")
    capped = row_gradient_norm(capped_trainer, "failed")

    assert on_policy > 1e-4
    assert uncapped > 0.5 * math.exp(GAP) * on_policy  # without a cap the gap multiplies the row's weight
    assert (
        capped <= FRESH_RATIO_CAP * on_policy
    )  # with the default cap it is bounded (past the cap: no gradient)
    over, tokens, largest = capped_trainer.behaviour_ratio_excess[0]
    assert over == tokens > 0 and largest == pytest.approx(GAP, abs=1e-4)
    assert logged(capped_trainer, "off_policy/frac_over_delta") == [1.0]  # logged for the batch


def test_cispo_has_its_own_weight_cap_and_does_not_clip_on_policy_tokens(
    tiny_engine, tiny_model_dir, tmp_path
):
    assert PolarGRPOConfig(output_dir=str(tmp_path), loss_type="cispo", report_to=[]).epsilon_high == 5.0
    assert CISPO_EPSILON_HIGH == 5.0
    explicit = PolarGRPOConfig(output_dir=str(tmp_path), loss_type="cispo", epsilon_high=3.0, report_to=[])
    assert explicit.epsilon_high == 3.0
    trainer = make_trainer(tiny_model_dir, task_groups(tiny_engine, 1), tmp_path / "cispo", loss_type="cispo")
    batch = trainer._generate_and_score_completions(trainer.train_data.rows)
    trainer.compute_loss(trainer.model, batch)
    # Ratio 1 (fresh rows, exact logprobs): inheriting epsilon = 0.2 as the cap clipped every positive-advantage token.
    assert logged(trainer, "cispo_clip_ratio") == [0.0]


def test_dr_grpo_divides_by_the_steps_rows_times_the_completion_budget(tiny_engine, tiny_model_dir, tmp_path):
    sequences = task_groups(tiny_engine, 1)
    budget = max(sum(s.loss_mask) for s in sequences)  # the most sampled tokens of a row
    for constant, expected in ((None, budget), (100, 100)):
        trainer = make_trainer(
            tiny_model_dir,
            sequences,
            tmp_path / f"dr{constant}",
            loss_type="dr_grpo",
            dr_grpo_constant=constant,
        )
        assert (
            trainer.max_completion_length == trainer.dr_grpo_constant == expected
        )  # not the longest sequence
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        batch = trainer._generate_and_score_completions(trainer.train_data.rows)
        (micro,) = trainer._split_micro_batches(batch)
        loss = float(trainer.compute_loss(trainer.model, micro))
        # At step 0 every ratio is 1, so each sampled token contributes -A: the loss is -Σ A·tokens / (rows · L).
        sampled = (micro["completion_mask"] * micro["tool_mask"]).sum(-1).float()
        expected_loss = -float((micro["advantages"] * sampled).sum()) / (len(sequences) * expected)
        assert loss == pytest.approx(expected_loss, abs=1e-6)


@pytest.mark.parametrize(
    "option",
    [
        {"mask_truncated_completions": True},
        {"top_p": 0.9},
        {"top_k": 20},
        {"use_vllm": True},
        {"log_completions": True},
        {"generation_kwargs": {"do_sample": True}},
    ],
    ids=lambda option: next(iter(option)),
)
def test_options_that_do_nothing_on_recorded_rollouts_are_refused_in_one_line(option, tmp_path):
    with pytest.raises(ValueError) as refused:
        PolarGRPOConfig(output_dir=str(tmp_path), report_to=[], **option)
    message = str(refused.value)
    assert (
        message.startswith(f"{next(iter(option))} does nothing on recorded rollouts: ")
        and "\n" not in message
    )


def test_a_cap_inside_the_clip_range_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"delta \(1.1\) must exceed 1 \+ epsilon_high \(1.28\)"):
        PolarGRPOConfig(output_dir=str(tmp_path), report_to=[], delta=1.1, epsilon_high=0.28)
    assert PolarGRPOConfig(output_dir=str(tmp_path), report_to=[]).delta == FRESH_RATIO_CAP


def test_the_straggler_cut_is_counted_per_iteration():
    task = load_tasks(EXAMPLES / "tasks.jsonl")[0]
    sessions = [
        SessionRun(task, i, f"s{i}", status=status, reward=reward)
        for i, (status, reward) in enumerate([("ok", 1.0), ("failed", 0.0), ("cut", None), ("cut", None)])
    ]
    assert cut_sessions(RolloutSummary(sessions, wall_seconds=1.0, run_utilisation=1.0)) == 2
