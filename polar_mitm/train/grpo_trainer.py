"""`PolarGRPOTrainer`: TRL's GRPO trainer fed with recorded rollouts instead of its own generations.

These TRL methods are overridden (pinned to trl==1.16.0, whose internals they follow), here:

- `_generate_and_score_completions`: instead of sampling, pad recorded rows into TRL's batch: prompt/completion ids
  and masks, `tool_mask` = our loss mask (1 = a token the engine sampled), the precomputed advantages, and
  `old_per_token_logps` = the recorded behaviour logprobs — so TRL's clipped ratio is pi_theta / pi_behaviour.
- `_get_per_token_logps_and_entropies`: every token scored at the temperature of the call that sampled it, of padded
  rows or of a packed row, and only the tokens the loss reads go through the LM head (train/scoring.py: on the tiny
  model's 151k vocabulary, 6–8× less CPU per step on the recorded harness sessions, benchmarks/bench_lm_head.py).
- `_compute_loss`: logs the per-row behaviour-logprob check of each micro-batch, and runs TRL's loss without its
  KL term, adding ours (train/kl.py: the estimator chosen, stale rows importance-weighted, the policy term's
  normaliser, loss tokens only).

and in the mixins, one concern each:

- `MicroBatchMixin` (train/micro_batches.py): `_get_train_sampler` — generation batches of whole task groups
  (every optimizer step holds whole groups, so its advantages have their baseline), zero-advantage groups left out
  (train/batching.py); `_prepare_inputs` — the scored batch cut into planned micro-batches, each trimmed to its own
  longest row or packed into one row (train/packing.py), every loss's normaliser the step's (train/normalisers.py);
  and `compute_loss` over a packed row.
- `ContinuationMixin` (train/continuation.py): `create_scheduler`, `train` and `_save_checkpoint`, so one
  optimizer, LR schedule and KL reference last a whole loop run, and a stopped run resumes exactly.
- `ActivationMemoryMixin` (train/activation_memory.py): at the end of the init, activation checkpointing turned on
  when the estimated activations of the largest micro-batch exceed the memory budget.

The other mixins add what those overrides call: `TokenTemperatureMixin` (train/temperature.py: TRL divides all
logits by one `temperature`; the final hidden states are scaled per token by T_global / T_token, which divides that
token's logits by T_token exactly for an LM head without bias or soft-capping), `BehaviourCheckMixin`
(train/behaviour_check.py: the recorded logprobs checked against the starting weights at step 0),
`StaleRolloutMixin` (train/staleness.py: rollouts older than the current policy get the decoupled correction — the
ratio anchored on the current weights' logprobs, each token weighted by pi_current / pi_behaviour, truncated),
`LossNormaliserMixin` (train/normalisers.py: every loss's normaliser the optimizer step's, or a constant of the
run), `KLPenaltyMixin` (train/kl.py), `TrainerMetricsMixin` (train/trainer_metrics.py) and `ModelSavingMixin`
(train/model_saving.py).

Everything else — the loss types, clipping, the reference model, PEFT, gradient accumulation, multi-process
training through accelerate, logging — is TRL's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from trl import GRPOTrainer
from trl.trainer.utils import use_adapter

from polar_mitm.train.activation_memory import ActivationMemoryMixin
from polar_mitm.train.batching import collate
from polar_mitm.train.behaviour_check import BehaviourCheckMixin
from polar_mitm.train.continuation import ContinuationMixin
from polar_mitm.train.data import TrainingData
from polar_mitm.train.grpo_config import PER_SEQUENCE_LOSSES, PolarGRPOConfig
from polar_mitm.train.kl import KLPenaltyMixin
from polar_mitm.train.micro_batches import MICRO_BATCH_PLAN, MicroBatchMixin
from polar_mitm.train.model_saving import ModelSavingMixin
from polar_mitm.train.normalisers import LossNormaliserMixin
from polar_mitm.train.packing import packed_logps
from polar_mitm.train.scoring import (
    disable_gradient_checkpointing,
    padded_logps,
    score_labelled_positions_on_cpu,
)
from polar_mitm.train.staleness import StaleRolloutMixin
from polar_mitm.train.stats import newest_weight_version
from polar_mitm.train.temperature import TokenTemperatureMixin
from polar_mitm.train.trainer_metrics import TrainerMetricsMixin

logger = logging.getLogger(__name__)

FORWARD_OPTIONS = ("compute_entropy", "compute_aux_loss")  # what our text-only forwards honour


def recorded_reward(completions: list[Any], reward: list[float] | None = None, **_: Any) -> list[float]:
    """The reward joined into the merged shards. TRL requires a reward source; the recorded rows carry theirs."""
    return [float(r) for r in reward or []]


class PolarGRPOTrainer(
    ContinuationMixin,
    MicroBatchMixin,
    LossNormaliserMixin,
    KLPenaltyMixin,
    ActivationMemoryMixin,
    BehaviourCheckMixin,
    StaleRolloutMixin,
    TokenTemperatureMixin,
    TrainerMetricsMixin,
    ModelSavingMixin,
    GRPOTrainer,
):
    """GRPO on merged sequences (MERGED_SCHEMA): the loss only on sampled tokens, ratios against behaviour logprobs.

    Args:
        model: a checkpoint directory or a loaded causal LM (as for TRL's `GRPOTrainer`).
        args: a `PolarGRPOConfig`.
        train_data: rows from `polar_mitm.train.data.build_training_data` (advantages already computed).
        processing_class: the tokenizer (loaded from `model` when omitted); only its pad id is used.
        callbacks: extra `TrainerCallback`s. With `args.push_to_engine`, the caller attaches the push
            (`polar_mitm.train.sync.attach_engine_push(trainer)`).
        peft_config: a PEFT config (e.g. `LoraConfig`) to train adapters instead of all weights.
    """

    _tag_names = ["trl", "grpo", "polar-mitm"]
    _name = "Polar GRPO"
    _scored_positions: torch.Tensor | None = None  # the completion tokens the forward scores (_scoring_only)
    _loss_logps: list[torch.Tensor] | None = None  # the policy logprobs TRL's loss computes (_compute_loss)

    def __init__(
        self,
        model,
        args: PolarGRPOConfig,
        train_data: TrainingData,
        processing_class=None,
        callbacks=None,
        peft_config=None,
    ) -> None:
        if args.strict_group_size and train_data.stats.group_size_mismatches:
            raise ValueError(
                f"{train_data.stats.group_size_mismatches} groups do not have {args.group_size} "
                f"sessions (sizes: {train_data.stats.group_sizes})"
            )
        self.train_data = train_data
        self.model_source = Path(model) if isinstance(model, str | Path) else None
        self.behaviour_logp_diff = None  # the step-0 check (train/behaviour_check.py), run on first use
        self.behaviour_ratio_excess = {}
        score_labelled_positions_on_cpu()  # the LM head skips what the loss never reads (train/scoring.py)
        # The dataset holds the rows, then zero-weight placeholders that fill the last length bucket.
        super().__init__(
            model=str(model) if isinstance(model, Path) else model,
            reward_funcs=recorded_reward,
            args=args,
            train_dataset=train_data.to_dataset(args.generation_batch_size),
            processing_class=processing_class,
            callbacks=callbacks,
            peft_config=peft_config,
        )
        self.base_weight_version = args.policy_weight_version or newest_weight_version(train_data.rows)
        self._init_continuation()
        self._install_temperature_hooks()
        self._log_data_summary()
        self._log_batch_plan()
        self._init_normalisers()  # after the run state and the batch plan: the constants may come from either
        self._choose_activation_checkpointing()  # before transformers' train() reads args.activation_checkpointing
        from polar_mitm.train.metrics import JsonlMetricsCallback

        self.add_callback(
            JsonlMetricsCallback(
                Path(args.output_dir) / args.metrics_file, step_offset=self.run_state.optimizer_steps
            )
        )

    # -- TRL overrides ---------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's scored batch from recorded rows: their own advantages, and their behaviour logprobs as the ratio
        anchor (the current weights' for stale rows, `_correct_stale_rows`), laid out for the planned
        micro-batches."""
        device = self.accelerator.device
        mode = "train" if self.model.training else "eval"
        real, plan = self._plan_generation(inputs, mode)
        parts = self.batch_plan().advantage  # recentred advantages of the groups trained in parts
        inputs = [
            {**inputs[i], "advantage": parts.get(inputs[i].get("row"), inputs[i]["advantage"])} for i in real
        ]
        batch = {k: v.to(device) for k, v in self._collate(inputs).items()}
        loss_mask, advantages = batch["loss_mask"], batch["advantages"]
        prompt_lens = [int(row["prompt_len"]) for row in inputs]

        staleness = self._token_staleness(inputs, loss_mask.size(1), device)
        loss_mask = self._mask_too_stale(loss_mask, staleness, mode)
        logp_diff = self._behaviour_check_values(inputs, device)
        if self.args.drop_mismatched_rows:
            # Rows whose recorded logprobs do not match the weights that sampled them leave the loss.
            loss_mask = loss_mask * ~(logp_diff > self.args.behaviour_logp_tolerance).unsqueeze(1)
        if self.loss_type in PER_SEQUENCE_LOSSES and self.args.session_weighting:
            # TRL's clipped objective is linear in A, so weighting A weights the sequence's loss (sign kept).
            advantages = advantages * batch["session_weight"]
        ref_per_token_logps = None
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            old_per_token_logps, advantages, importance = self._correct_stale_rows(
                batch, plan, prompt_lens, loss_mask, advantages, staleness, mode
            )
            if self.beta != 0.0:
                ref_per_token_logps = self._planned_logps(batch, plan, prompt_lens, self._reference_logps)

        num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()
        row_weight = None
        if mode == "train":
            advantages, row_weight = self._weigh_for_micro_batches(
                advantages, loss_mask, plan, batch["session_weight"], mode
            )
        self._log_batch_metrics(mode, batch, staleness, plan, inputs)
        output = {
            "prompt_ids": batch["prompt_ids"],
            "prompt_mask": batch["prompt_mask"],
            "completion_ids": batch["completion_ids"],
            "completion_mask": batch["completion_mask"],
            "tool_mask": loss_mask,
            "advantages": advantages,
            "num_items_in_batch": num_items_in_batch,
            "old_per_token_logps": old_per_token_logps,
            "sampling_per_token_logps": batch["behaviour_logps"],
            "token_temperature": batch["token_temperature"],
            "behaviour_logp_diff": logp_diff,
            "placeholder": batch["placeholder"],
            "prompt_lens": torch.tensor(prompt_lens, device=device),
            MICRO_BATCH_PLAN: plan,
        }
        if ref_per_token_logps is not None:
            # The KL term's per-token weights (train/kl.py): the stale rows' importance weights, and with them the
            # weight of each token in the policy term's normaliser.
            importance = torch.ones_like(loss_mask, dtype=torch.float32) if importance is None else importance
            output["ref_per_token_logps"] = ref_per_token_logps
            output["kl_importance_weight"] = importance
            if row_weight is not None:
                output["kl_weight"] = importance * row_weight.unsqueeze(1)
        return output

    def _compute_loss(self, model, inputs):
        """TRL's loss without its KL term, then ours on the same policy logprobs (train/kl.py)."""
        self._log_behaviour_check(inputs)
        mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
        kl = self.beta != 0.0 and inputs.get("ref_per_token_logps") is not None
        with (
            self.scoring_temperatures(inputs.get("token_temperature")),
            self._scoring_only(mask),
            self._without_trl_kl(),
            self._keeping_loss_logps() as logps,
        ):
            loss = super()._compute_loss(model, inputs)
        if kl:
            loss = loss + self._kl_penalty(inputs, logps[-1], mask)
        return loss

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs
    ):
        """TRL's logprobs, with each completion token scored at its own temperature (`scoring_temperatures`), of
        padded rows or of a packed row (`_packed_rows`), only where the loss reads them (`_scoring_only`)."""
        temperatures, scored = self._token_temperature, self._scored_positions
        if temperatures is None or bool((temperatures == self.temperature).all()):
            logps, entropies, aux = self._layout_logps(
                model, input_ids, attention_mask, logits_to_keep, batch_size, scored, **kwargs
            )
        else:
            logps, entropies, aux = self._per_temperature_logps(
                model, input_ids, attention_mask, logits_to_keep, batch_size, temperatures, scored, **kwargs
            )
        if self._loss_logps is not None:
            self._loss_logps.append(logps)
        return logps, entropies, aux

    def _layout_logps(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size, scored=None, **kwargs
    ):
        """TRL's fused head on padded rows (`scoring.padded_logps`, TRL's text-only forward); on a packed row the
        same head, with position ids that restart per sequence and attention that stays inside each
        (`packing.packed_logps`). Either scores only the `scored` completion tokens (None: all)."""
        unsupported = sorted(k for k, v in kwargs.items() if v is not None and k not in FORWARD_OPTIONS)
        if unsupported:
            raise ValueError(f"the trainer's forward takes text only, not {unsupported}")
        options = {
            "compute_entropy": bool(kwargs.get("compute_entropy")),
            "compute_aux_loss": bool(kwargs.get("compute_aux_loss")),
            "autocast": self.accelerator.autocast(),
        }
        position_ids = self._packed_position_ids
        if position_ids is None:
            return padded_logps(
                model, input_ids, attention_mask, logits_to_keep, batch_size, scored, **options
            )
        if position_ids.shape != input_ids.shape:
            raise ValueError("a packed row cannot carry other position ids")
        return packed_logps(model, input_ids, position_ids, logits_to_keep, scored, **options)

    # -- scoring -----------------------------------------------------------------------------------------------------

    def _collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pad_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        return collate(rows, pad_token_id=pad_id, default_temperature=self.temperature)

    def policy_logps(self, batch: dict[str, torch.Tensor], model=None) -> torch.Tensor:
        """Logprobs of a batch's sampled completion tokens (its loss mask; 0 elsewhere) under `model` (default: the
        policy), each at its own temperature — what the loss compares with the behaviour logprobs."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        sampled = batch["loss_mask"] if "loss_mask" in batch else batch["tool_mask"]
        with (
            torch.no_grad(),
            self.scoring_temperatures(batch["token_temperature"]),
            self._scoring_only(sampled.bool() & batch["completion_mask"].bool()),
        ):
            return self._get_per_token_logps_and_entropies(
                model or self.model, input_ids, attention_mask, batch["completion_ids"].size(1)
            )[0]

    def _policy_forward(self, input_ids, attention_mask, logits_to_keep, batch_size) -> torch.Tensor:
        return self._get_per_token_logps_and_entropies(
            self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
        )[0]

    def _reference_logps(
        self, input_ids, attention_mask, logits_to_keep, forward_batch
    ) -> torch.Tensor | None:
        """Logprobs under the reference model (beta > 0): TRL's ref model, or the base model under a LoRA."""
        if self.beta == 0.0:
            return None
        if self.ref_model is not None:
            return self._get_per_token_logps_and_entropies(
                self.ref_model, input_ids, attention_mask, logits_to_keep, batch_size=forward_batch
            )[0]
        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, logits_to_keep, batch_size=forward_batch
            )[0]

    @contextmanager
    def _scoring_only(self, positions: torch.Tensor | None) -> Iterator[None]:
        """Forward passes inside score only these completion tokens ([B, completion], None: all); the logprob and
        entropy of the others are 0 (train/scoring.py)."""
        previous = self._scored_positions
        self._scored_positions = None if positions is None else positions.bool()
        try:
            yield
        finally:
            self._scored_positions = previous

    @contextmanager
    def _keeping_loss_logps(self) -> Iterator[list[torch.Tensor]]:
        """The policy logprobs of the forward passes inside (TRL's loss makes one), for the KL term."""
        self._loss_logps = kept = []
        try:
            yield kept
        finally:
            self._loss_logps = None
