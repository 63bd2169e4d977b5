"""`PolarGRPOTrainer`: TRL's GRPO trainer fed with recorded rollouts instead of its own generations.

These TRL methods are overridden (pinned to trl==1.16.0, whose internals they follow):

- `_get_train_sampler`: generation batches of whole task groups (every optimizer step holds whole groups, so its
  advantages have their baseline), zero-advantage groups left out, instead of prompt repeats (train/batching.py);
- `_generate_and_score_completions`: instead of sampling, pad recorded rows into TRL's batch: prompt/completion ids
  and masks, `tool_mask` = our loss mask (1 = a token the engine sampled), the precomputed advantages, and
  `old_per_token_logps` = the recorded behaviour logprobs — so TRL's clipped ratio is pi_theta / pi_behaviour.
  Rollouts older than the current policy get the decoupled correction: the ratio is anchored on the current
  weights' logprobs and each token is weighted by pi_current / pi_behaviour, truncated (TIS).
- `_prepare_inputs`: the scored batch is cut into planned micro-batches — each trimmed to its own longest row, or
  packed into one row with position ids restarting per sequence (train/packing.py) — instead of TRL's shuffled
  equal splits at the batch's full width; every loss's normaliser stays the optimizer step's.
- `_get_per_token_logps_and_entropies`: every token is scored at the temperature of the call that sampled it (TRL
  divides all logits by one `temperature`; we scale the final hidden states per token by T_global / T_token, which
  divides that token's logits by T_token exactly for an LM head without bias or soft-capping), and only the tokens
  the loss reads go through the LM head (train/scoring.py: on the tiny model's 151k vocabulary, 6–8× less CPU per
  step on the recorded harness sessions, benchmarks/bench_lm_head.py).
- `_compute_loss`: logs the per-row behaviour-logprob check of each micro-batch, and makes TRL's KL exactly 0 on
  tokens outside the loss (policy and reference logprobs there both set to the ratio anchor before TRL
  exponentiates their differences), so a context token cannot overflow exp() into inf · 0 = NaN.
- from `ContinuationMixin` (train/continuation.py): `create_scheduler`, `train` and `_save_checkpoint`, so one
  optimizer, LR schedule and KL reference last a whole loop run, and a stopped run resumes exactly.

Everything else — the loss types, clipping, KL to a reference, PEFT, gradient accumulation, multi-process
training through accelerate, logging — is TRL's.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.trainer.utils import use_adapter

from polar_mitm.train.batching import (
    BatchPlan,
    BatchShape,
    GroupBatchSampler,
    MicroBatchPlan,
    collate,
    group_key,
    plan_batches,
    plan_micro_batches,
)
from polar_mitm.train.continuation import ContinuationMixin
from polar_mitm.train.data import TrainingData
from polar_mitm.train.grpo_config import PolarGRPOConfig
from polar_mitm.train.packing import (
    PROMPT_KEYS,
    as_filler,
    attention_refusal,
    packed_logps,
    packed_micro_batch,
    packing_refusal,
    scatter_micro_batch,
    trimmed_micro_batch,
    use_segment_attention,
)
from polar_mitm.train.scoring import padded_logps, score_labelled_positions_on_cpu
from polar_mitm.train.stats import newest_weight_version, version_distance
from polar_mitm.train.sync import set_checkpoint_dtype, write_dtype

logger = logging.getLogger(__name__)

LOG_RATIO_CLAMP = 20.0  # exp(±20) keeps sequence-level weights finite
PER_SEQUENCE_LOSSES = ("grpo", "sapo")  # TRL averages each sequence's tokens, then the sequences
# Losses TRL normalises per micro-batch: by its rows, or by its loss tokens (the rest: by num_items_in_batch).
ROW_AVERAGED_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")
TOKEN_AVERAGED_LOSSES = ("bnpo",)
MICRO_BATCH_PLAN = "micro_batch_plan"  # the scored batch's MicroBatchPlan, cut by _split_micro_batches
FORWARD_OPTIONS = ("compute_entropy", "compute_aux_loss")  # what our text-only forwards honour
BEHAVIOUR_CHECK_FILE = "behaviour_check.json"
WORST_ROWS_REPORTED = 20
MODEL_METADATA_FILES = ("polar_model.json",)  # tells `polar-mitm serve` which parsers the model family uses


@contextmanager
def disable_gradient_checkpointing(
    model, gradient_checkpointing_kwargs: dict | None = None
) -> Iterator[None]:
    """TRL's helper of the same name, reading transformers 5's `is_activation_checkpointing` (TRL 1.16 reads the
    deprecated `is_gradient_checkpointing`, which warns on every training step)."""
    was_enabled = model.is_activation_checkpointing
    if was_enabled:
        model.gradient_checkpointing_disable()
    try:
        yield
    finally:
        if was_enabled:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs)


def recorded_reward(completions: list[Any], reward: list[float] | None = None, **_: Any) -> list[float]:
    """The reward joined into the merged shards. TRL requires a reward source; the recorded rows carry theirs."""
    return [float(r) for r in reward or []]


class PolarGRPOTrainer(ContinuationMixin, GRPOTrainer):
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
    _batch_plan: BatchPlan | None = None  # built on first use (batch_plan)
    _packs: bool | None = None  # decided on first use (packs_micro_batches)
    _packed_position_ids: torch.Tensor | None = None  # the packed row being scored (_packed_rows)
    _scored_positions: torch.Tensor | None = None  # the completion tokens the forward scores (_scoring_only)

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
        self._token_temperature: torch.Tensor | None = (
            None  # per-token scoring temperatures of the current forward
        )
        self._hidden_factor: torch.Tensor | None = (
            None  # what the backbone hook multiplies the hidden states by
        )
        self._kl_anchor: tuple[torch.Tensor, torch.Tensor] | None = (
            None  # (loss mask, logps outside the loss)
        )
        self.behaviour_logp_diff: dict[int, float] | None = (
            None  # row → mean |recomputed - recorded|, at step 0
        )
        # row → (sampled tokens whose step-0 ratio trainer/engine exceeds the fresh-row cap, sampled tokens, max log ratio)
        self.behaviour_ratio_excess: dict[int, tuple[int, int, float]] = {}
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
        if self.loss_type == "dr_grpo":
            # Dr. GRPO's constant normaliser is the longest completion; here, the data's longest sequence.
            self.max_completion_length = max(train_data.lengths())
        self._install_temperature_hooks()
        self._log_data_summary()
        from polar_mitm.train.metrics import JsonlMetricsCallback

        self.add_callback(
            JsonlMetricsCallback(
                Path(args.output_dir) / args.metrics_file, step_offset=self.run_state.optimizer_steps
            )
        )

    # -- versions --------------------------------------------------------------------------------------------------

    def policy_weight_version(self) -> str:
        """The version of the weights being trained: the starting version plus one per optimizer step."""
        base, steps = self.base_weight_version, self.state.global_step
        if base is None:
            return str(steps)
        return str(int(base) + steps) if base.isdigit() else f"{base}+{steps}"

    def staleness(self, recorded_version: str | None) -> int:
        """Weight updates between the weights that sampled a rollout and the weights now being trained."""
        return version_distance(self.base_weight_version, recorded_version) + self.state.global_step

    # -- TRL overrides ---------------------------------------------------------------------------------------------

    def _get_train_sampler(self, dataset=None) -> GroupBatchSampler:
        """Whole groups per optimizer step, zero-advantage groups left out (`batching.plan_batches`)."""
        return GroupBatchSampler(
            self.batch_plan(),
            self._batch_shape(),
            placeholder=len(self.train_data.rows),  # TrainingData.to_dataset puts one there
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            shuffle=bool(self.shuffle_dataset),
            seed=self.args.seed,
        )

    def _prepare_inputs(self, generation_batch: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's buffering of a generation batch, cut into the planned micro-batches (each trimmed to its own rows,
        or packed) instead of TRL's shuffled equal splits at the batch's full width."""
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self._split_micro_batches(
                self._generate_and_score_completions(generation_batch)
            )
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self._packed_rows(inputs.get("position_ids")):  # a packed micro-batch's forward
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        device = self.accelerator.device
        mode = "train" if self.model.training else "eval"
        real, plan = self._plan_generation(inputs, mode)
        parts = self.batch_plan().advantage  # recentred advantages of the groups trained in parts
        inputs = [
            {**inputs[i], "advantage": parts.get(inputs[i].get("row"), inputs[i]["advantage"])} for i in real
        ]
        batch = {k: v.to(device) for k, v in self._collate(inputs).items()}
        loss_mask, behaviour_logps, advantages = (
            batch["loss_mask"],
            batch["behaviour_logps"],
            batch["advantages"],
        )
        prompt_lens = [int(row["prompt_len"]) for row in inputs]

        logp_diff = self._behaviour_check_values(inputs, device)
        if self.args.drop_mismatched_rows:
            # Rows whose recorded logprobs do not match the weights that sampled them leave the loss.
            loss_mask = loss_mask * ~(logp_diff > self.args.behaviour_logp_tolerance).unsqueeze(1)
        if self.loss_type in PER_SEQUENCE_LOSSES and self.args.session_weighting:
            # TRL's clipped objective is linear in A, so weighting A weights the sequence's loss (sign kept).
            advantages = advantages * batch["session_weight"]
        staleness = torch.tensor([self.staleness(row.get("weight_version")) for row in inputs], device=device)
        stale = staleness > 0
        # Decided across processes: a forward pass under ZeRO-3/FSDP is collective, so all ranks run it or none does.
        any_stale = self.accelerator.gather(stale.any().float().reshape(1)).max().item() > 0
        old_per_token_logps = behaviour_logps
        ref_per_token_logps = None
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            if self.args.stale_correction != "none" and any_stale:
                current_logps = self._planned_logps(batch, plan, prompt_lens, self._policy_forward)
                weights = self._stale_importance_weights(
                    current_logps, behaviour_logps, loss_mask, stale, mode
                )
                anchor_current = stale.unsqueeze(1) & loss_mask.bool()
                old_per_token_logps = torch.where(anchor_current, current_logps, behaviour_logps)
                # A non-negative weight on the advantage is the weight on the token's loss: TRL's clipped objective
                # is linear in A, and the sign (which the clip metrics read) is kept.
                advantages = (
                    advantages.unsqueeze(1) * weights if advantages.dim() == 1 else advantages * weights
                )
            if self.beta != 0.0:
                ref_per_token_logps = self._planned_logps(batch, plan, prompt_lens, self._reference_logps)

        num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()
        if mode == "train":
            advantages = self._weigh_for_micro_batches(advantages, loss_mask, plan)
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
            "sampling_per_token_logps": behaviour_logps,
            "token_temperature": batch["token_temperature"],
            "behaviour_logp_diff": logp_diff,
            "placeholder": batch["placeholder"],
            "prompt_lens": torch.tensor(prompt_lens, device=device),
            MICRO_BATCH_PLAN: plan,
        }
        if ref_per_token_logps is not None:
            output["ref_per_token_logps"] = ref_per_token_logps
        return output

    def _compute_loss(self, model, inputs):
        self._log_behaviour_check(inputs)
        mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool()
        anchor = None
        if self.beta != 0.0 and inputs.get("ref_per_token_logps") is not None:
            # Outside the loss, TRL's KL and ratio terms are multiplied by 0 after exp(); give the policy and the
            # reference the same finite value there (the ratio anchor), so both exponents are exactly 0 and no
            # token outside the loss can overflow into inf · 0 = NaN. Inside the loss, TRL's formula is untouched.
            anchor = inputs["old_per_token_logps"].detach()
            inputs = {
                **inputs,
                "ref_per_token_logps": torch.where(mask, inputs["ref_per_token_logps"], anchor),
            }
        with (
            self.scoring_temperatures(inputs.get("token_temperature")),
            self._kl_zero_outside_loss(mask, anchor),
            self._scoring_only(mask),
        ):
            return super()._compute_loss(model, inputs)

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
        if self._kl_anchor is not None:  # see _compute_loss; no gradient flows outside the loss, as before
            mask, anchor = self._kl_anchor
            logps = torch.where(mask, logps, anchor.to(logps.dtype))
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

    # -- per-token temperatures ------------------------------------------------------------------------------------

    @contextmanager
    def scoring_temperatures(self, token_temperature: torch.Tensor | None) -> Iterator[None]:
        """Score the completion tokens of the forward passes inside at these temperatures ([B, completion])."""
        previous, self._token_temperature = self._token_temperature, token_temperature
        try:
            yield
        finally:
            self._token_temperature = previous

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
    def _kl_zero_outside_loss(self, mask: torch.Tensor, anchor: torch.Tensor | None) -> Iterator[None]:
        self._kl_anchor = (mask, anchor) if anchor is not None else None
        try:
            yield
        finally:
            self._kl_anchor = None

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

    def _per_temperature_logps(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size, temperatures, scored, **kwargs
    ):
        """TRL's fused head at `self.temperature`, with the hidden state that predicts each completion token scaled
        by self.temperature / its temperature: (h · s) W / T_global = h W / T_token."""
        batch_size = batch_size or input_ids.size(0)
        factor = torch.ones(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        width = input_ids.size(1)
        # Position p's hidden state predicts token p + 1: completion token j sits at width - logits_to_keep + j.
        factor[:, width - logits_to_keep - 1 : width - 1] = self.temperature / temperatures.to(factor.device)
        parts = []
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            self._hidden_factor = factor[start:end]
            try:
                parts.append(
                    self._layout_logps(
                        model,
                        input_ids[start:end],
                        attention_mask[start:end],
                        logits_to_keep,
                        end - start,
                        None if scored is None else scored[start:end],
                        **kwargs,
                    )
                )
            finally:
                self._hidden_factor = None
        logps = torch.cat([p[0] for p in parts])
        entropies = torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None
        aux = torch.stack([p[2] for p in parts]).mean() if parts[0][2] is not None else None
        return logps, entropies, aux

    def _install_temperature_hooks(self) -> None:
        """Hook the backbones TRL's fused head reads (policy and reference) to apply `_hidden_factor`."""
        temperatures = {t for row in self.train_data.rows for t in row["turn_temperatures"] if t is not None}
        mixed = bool(temperatures - {self.temperature})
        for model in (self.model, self.ref_model):
            if model is None:
                continue
            lm = self.accelerator.unwrap_model(model)
            lm = lm.get_base_model() if is_peft_model(lm) else lm  # the model TRL put its fused head on
            if mixed:
                self._check_scalable_head(lm, temperatures)
            lm.base_model.register_forward_hook(self._scale_hidden_states)

    def _check_scalable_head(self, lm, temperatures: set[float]) -> None:
        head = lm.get_output_embeddings()
        softcap = getattr(lm.config.get_text_config(), "final_logit_softcapping", None)
        if getattr(head, "bias", None) is not None or softcap is not None:
            sessions = sorted(
                {
                    r["session_id"]
                    for r in self.train_data.rows
                    if set(r["turn_temperatures"]) - {None, self.temperature}
                }
            )
            raise ValueError(
                f"rows were sampled at temperatures {sorted(temperatures)} but this model's LM head (bias or logit "
                f"soft-capping) cannot be scored per token; train them separately, each with its own --temperature "
                f"(sessions not at {self.temperature}: {', '.join(sessions[:10])}{' …' if len(sessions) > 10 else ''})"
            )

    def _scale_hidden_states(self, module, args, output):
        if self._hidden_factor is None:
            return output
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        scaled = hidden * self._hidden_factor.to(device=hidden.device, dtype=hidden.dtype).unsqueeze(-1)
        if isinstance(output, tuple):
            return (scaled, *output[1:])
        output.last_hidden_state = scaled
        return output

    # -- behaviour logprob check -----------------------------------------------------------------------------------

    def _collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pad_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        return collate(rows, pad_token_id=pad_id, default_temperature=self.temperature)

    def _behaviour_check_values(self, inputs: list[dict[str, Any]], device) -> torch.Tensor:
        """Per row of `inputs`: its step-0 mean |recomputed - recorded| (NaN: unchecked, stale, or a placeholder)."""
        if self.args.check_behaviour_logps and self.behaviour_logp_diff is None:
            self.behaviour_logp_diff = self._run_behaviour_check()
        checked = self.behaviour_logp_diff or {}
        values = [
            math.nan if row.get("placeholder") else checked.get(row.get("row"), math.nan) for row in inputs
        ]
        self._log_ratio_cap(inputs, device)
        return torch.tensor(values, dtype=torch.float32, device=device)

    def fresh_ratio_cap(self) -> float:
        """The cap on a fresh row's ratio against the engine's logprobs: CISPO's weight cap, else TRL's `delta`."""
        if self.loss_type == "cispo":
            return float(self.epsilon_high)
        return math.inf if self.args.delta is None else float(self.args.delta)

    def _log_ratio_cap(self, inputs: list[dict[str, Any]], device) -> None:
        """Per generation batch, from the step-0 check: the share of its checked sampled tokens whose ratio
        pi_trainer / pi_engine exceeds the fresh-row cap (they get no gradient), and the largest such log ratio."""
        excess = [
            self.behaviour_ratio_excess.get(row.get("row")) for row in inputs if not row.get("placeholder")
        ]
        excess = [e for e in excess if e is not None]
        over, tokens = sum(e[0] for e in excess), sum(e[1] for e in excess)
        top = max((e[2] for e in excess), default=-math.inf)
        totals = self.accelerator.reduce(
            torch.tensor([float(over), float(tokens)], device=device), reduction="sum"
        )
        if totals[1] > 0:
            mode = "train" if self.model.training else "eval"
            largest = self.accelerator.gather(torch.tensor([top], device=device)).max().item()
            self._metrics[mode]["off_policy/frac_over_delta"].append((totals[0] / totals[1]).item())
            self._metrics[mode]["off_policy/step0_log_ratio_max"].append(largest)

    def _run_behaviour_check(self) -> dict[int, float]:
        """Score every row sampled by the starting weights once, before the first step, split across processes.

        Done up front because afterwards no row is fresh (each step moves the weights on), so a per-batch check at
        the current weights would see only stale rows and hide a mismatch inside the stale-rollout weights.
        """
        rows = self.train_data.rows
        fresh = sorted(
            (
                i
                for i, r in enumerate(rows)
                if version_distance(self.base_weight_version, r.get("weight_version")) == 0
            ),
            key=lambda i: len(rows[i]["input_ids"]),
        )
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        mine, size = fresh[rank::world], self.args.per_device_train_batch_size
        # Every rank runs the same number of forward passes (collective under ZeRO-3/FSDP).
        local = torch.tensor([math.ceil(len(mine) / size)], device=self.accelerator.device)
        n_batches = int(self.accelerator.gather(local).max().item())
        results: dict[int, tuple[float, int, int, float]] = {}
        for b in range(n_batches):
            chunk = mine[b * size : (b + 1) * size] or fresh[:1]
            for i, value in zip(chunk, self._row_logp_diff([rows[i] for i in chunk]), strict=True):
                results[i] = value
        from accelerate.utils import gather_object

        merged = dict(pair for pair in gather_object(list(results.items())))
        self.behaviour_ratio_excess = {i: value[1:] for i, value in merged.items()}
        diffs = {i: value[0] for i, value in merged.items()}
        self._write_behaviour_report(diffs, unchecked=len(rows) - len(fresh))
        return diffs

    def _row_logp_diff(self, rows: list[dict[str, Any]]) -> list[tuple[float, int, int, float]]:
        """Per row: mean |logprob under the current weights - recorded logprob| over its sampled tokens; how many of
        them have a ratio pi_current / pi_recorded over the fresh-row cap; its sampled tokens; the largest log ratio."""
        batch = {k: v.to(self.accelerator.device) for k, v in self._collate(rows).items()}
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps = self.policy_logps(batch)
        mask = batch["loss_mask"].bool()
        log_ratio = logps - batch["behaviour_logps"]
        diff = (log_ratio.abs() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        over = ((log_ratio > math.log(self.fresh_ratio_cap())) & mask).sum(-1)
        largest = torch.where(mask, log_ratio, torch.full_like(log_ratio, -math.inf)).max(-1).values
        return list(zip(diff.tolist(), over.tolist(), mask.sum(-1).tolist(), largest.tolist(), strict=True))

    def _write_behaviour_report(self, diffs: dict[int, float], unchecked: int) -> None:
        rows, tolerance = self.train_data.rows, self.args.behaviour_logp_tolerance
        over = sorted((i for i, d in diffs.items() if d > tolerance), key=lambda i: -diffs[i])
        report = {
            "tolerance": tolerance,
            "rows_checked": len(diffs),
            "rows_unchecked_stale": unchecked,
            "rows_over_threshold": len(over),
            "rows_dropped": len(over) if self.args.drop_mismatched_rows else 0,
            "fresh_ratio_cap": self.fresh_ratio_cap() if math.isfinite(self.fresh_ratio_cap()) else None,
            "tokens_over_cap": sum(e[0] for e in self.behaviour_ratio_excess.values()),
            "tokens_checked": sum(e[1] for e in self.behaviour_ratio_excess.values()),
            "mean_abs_diff": sum(diffs.values()) / len(diffs) if diffs else None,
            "max_abs_diff": max(diffs.values()) if diffs else None,
            "worst_rows": [
                {
                    "sequence_id": rows[i]["sequence_id"],
                    "session_id": rows[i]["session_id"],
                    "mean_abs_diff": diffs[i],
                }
                for i in over[:WORST_ROWS_REPORTED]
            ],
        }
        if over:
            names = ", ".join(f"{rows[i]['session_id']} ({diffs[i]:.3g})" for i in over[:5])
            logger.warning(
                "%d of %d rows sampled by the starting weights have recorded logprobs off by more than "
                "%g nats on average (%s%s)%s: wrong temperature, weights or tokens?",
                len(over),
                len(diffs),
                tolerance,
                names,
                " …" if len(over) > 5 else "",
                "; left out of the loss" if self.args.drop_mismatched_rows else "",
            )
        if self.accelerator.is_main_process:
            out = Path(self.args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / BEHAVIOUR_CHECK_FILE).write_text(json.dumps(report, indent=2))

    def _log_behaviour_check(self, inputs: dict[str, torch.Tensor]) -> None:
        """Each micro-batch's rows' check values: the metric reaches metrics.jsonl on every step."""
        if not self.args.check_behaviour_logps or "behaviour_logp_diff" not in inputs:
            return
        mode = "train" if self.model.training else "eval"
        real = ~inputs["placeholder"]
        diffs = self._gather_values(inputs["behaviour_logp_diff"][real])  # NaN (unchecked) rows drop out here
        n_real = self.accelerator.reduce(real.sum().float().reshape(1), reduction="sum").item()
        metrics = self._metrics[mode]
        metrics["logp_diff/frac_checked"].append(diffs.numel() / max(n_real, 1.0))
        if diffs.numel():
            metrics["logp_diff/fresh_mean"].append(diffs.mean().item())
            metrics["logp_diff/fresh_max"].append(diffs.max().item())
            metrics["logp_diff/frac_over_threshold"].append(
                (diffs > self.args.behaviour_logp_tolerance).float().mean().item()
            )

    def _log_data_summary(self) -> None:
        stats = self.train_data.stats
        if stats.unknown_temperature_sequences:
            logger.warning(
                "%d sequences have no recorded sampling temperature (v1 data): scored at --temperature %g",
                stats.unknown_temperature_sequences,
                self.temperature,
            )
        excluded = (
            stats.excluded_greedy_turns + stats.excluded_truncated_turns + stats.excluded_constrained_turns
        )
        if excluded:
            logger.info(
                "left out of the loss: %d greedy, %d top-p/top-k/min-p-truncated and %d grammar-constrained "
                "calls (%d sampled tokens; %d sequences with nothing else), see --keep-truncated-sampling",
                stats.excluded_greedy_turns,
                stats.excluded_truncated_turns,
                stats.excluded_constrained_turns,
                stats.excluded_sampled_tokens,
                stats.dropped_excluded_sampling,
            )
        if (
            self.loss_type in PER_SEQUENCE_LOSSES
            and not self.args.session_weighting
            and stats.sequences_per_session_max > 1
        ):
            logger.warning(
                "loss_type=%s weighs every sequence alike and sessions have up to %d sequences: "
                "sessions with more sequences count more (session_weighting is off)",
                self.loss_type,
                stats.sequences_per_session_max,
            )
        self._log_batch_plan()

    def _log_batch_plan(self) -> None:
        """What the batch plan left out (dynamic sampling) or changed (groups larger than a chunk), into the data
        stats and the log."""
        stats, plan, shape = self.train_data.stats, self.batch_plan(), self._batch_shape()
        self.packs_micro_batches()  # decided (and a layout that cannot be used refused) before the first step
        if plan.zero_advantage_groups:
            stats.zero_advantage_groups = plan.zero_advantage_groups
            stats.zero_advantage_sequences = plan.zero_advantage_rows
            stats.zero_advantage_tokens = plan.zero_advantage_tokens
            logger.info(
                "dynamic sampling: %d groups with zero advantage (%d sequences, %d tokens) left out of the batches "
                "and the loss normaliser (--keep-zero-advantage-groups keeps them)",
                plan.zero_advantage_groups,
                plan.zero_advantage_rows,
                plan.zero_advantage_tokens,
            )
        stats.zero_advantage_kept = plan.zero_advantage_kept
        if plan.zero_advantage_kept and not self.args.keep_zero_advantage_groups:
            logger.warning(
                "no group has a nonzero advantage: training on them as they are (nothing to learn)"
            )
        stats.split_groups, stats.uncentred_parts = plan.split_groups, plan.uncentred_parts
        if plan.split_groups:
            logger.warning(
                "%d groups have more sequences than an optimizer step's chunk (%d rows = per-device batch × "
                "processes × %d micro-batches): trained in parts, each recentred on its own mean advantage%s",
                plan.split_groups,
                shape.chunk_rows,
                shape.micro_per_chunk,
                f"; {plan.uncentred_parts} parts hold one session or one reward and keep the group's advantages"
                if plan.uncentred_parts
                else "",
            )
        if plan.chunks and plan.rows_per_chunk < 0.75:
            logger.info(
                "whole groups fill %.0f%% of each optimizer step's %d rows: a per-device batch × accumulation that "
                "is a multiple of the group's sequences fills them",
                100 * plan.rows_per_chunk,
                shape.chunk_rows,
            )

    # -- batches: whole groups, micro-batches without padding waste (train/batching.py, train/packing.py) -----------

    def _batch_shape(self) -> BatchShape:
        return BatchShape(
            per_device=self.args.per_device_train_batch_size,
            processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation,
            accumulation_steps=self.args.gradient_accumulation_steps,
        )

    def batch_plan(self) -> BatchPlan:
        """Which rows share a chunk of an optimizer step (built once; every process builds the same)."""
        if self._batch_plan is None:
            self._batch_plan = plan_batches(
                self.train_data.rows,
                self._batch_shape(),
                keep_zero_advantage=self.args.keep_zero_advantage_groups,
            )
        return self._batch_plan

    def packs_micro_batches(self) -> bool:
        """Whether micro-batches are packed rows (`batch_layout`: auto packs wherever that is exact)."""
        if self._packs is None:
            reason = packing_refusal(
                self.loss_type, self.args.importance_sampling_level, self.args.off_policy_mask_threshold
            )
            for model in (self.model, self.ref_model):
                reason = reason or (attention_refusal(model) if model is not None else None)
            if self.args.batch_layout == "packed" and reason:
                raise ValueError(f"batch_layout=packed cannot be used with {reason}")
            self._packs = self.args.batch_layout != "padded" and reason is None
            for model in (self.model, self.ref_model) if self._packs else ():
                if model is not None:
                    use_segment_attention(model)
            logger.info(
                "micro-batches: %s",
                "packed" if self._packs else f"padded, each trimmed ({reason or 'asked'})",
            )
        return self._packs

    def _plan_generation(self, inputs: list[dict[str, Any]], mode: str) -> tuple[list[int], MicroBatchPlan]:
        """The real rows of this process's generation batch and its micro-batches: in training, the
        `micro_per_chunk` micro-batches of each chunk `GroupBatchSampler` laid out; in evaluation, batches of
        `per_device_eval_batch_size`."""
        shape = self._batch_shape()
        if mode == "train":
            slots, per_chunk = shape.chunk_slots, shape.micro_per_chunk
        else:
            slots, per_chunk = len(inputs), math.ceil(len(inputs) / self.args.per_device_eval_batch_size)
        return plan_micro_batches(inputs, slots, per_chunk, packed=self.packs_micro_batches())

    def _policy_forward(self, input_ids, attention_mask, logits_to_keep, batch_size) -> torch.Tensor:
        return self._get_per_token_logps_and_entropies(
            self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
        )[0]

    def _planned_logps(
        self, batch: dict[str, Any], plan: MicroBatchPlan, prompt_lens: list[int], forward
    ) -> torch.Tensor:
        """`forward(input_ids, attention_mask, logits_to_keep, batch_size)` on each planned micro-batch — trimmed
        or packed, each token at its own temperature — written back into the batch's [B, W] completion layout."""
        layout = {
            key: batch[key]
            for key in (*PROMPT_KEYS, "completion_ids", "completion_mask", "token_temperature", "loss_mask")
        }
        out = torch.zeros_like(batch["behaviour_logps"])
        for rows in plan.micro:
            if not rows:
                continue
            micro = self._micro_batch(layout, rows, prompt_lens, plan.packed)
            input_ids = torch.cat([micro["prompt_ids"], micro["completion_ids"]], dim=1)
            attention_mask = torch.cat([micro["prompt_mask"], micro["completion_mask"]], dim=1)
            with (
                self.scoring_temperatures(micro["token_temperature"]),
                self._packed_rows(micro.get("position_ids")),
                self._scoring_only(micro["loss_mask"].bool() & micro["completion_mask"].bool()),
            ):
                values = forward(input_ids, attention_mask, micro["completion_ids"].size(1), len(rows))
            scatter_micro_batch(values, layout, micro, rows, out)
        return out

    def _micro_batch(
        self, batch: dict[str, Any], rows: list[int], prompt_lens: list[int], packed: bool
    ) -> dict[str, Any]:
        if packed:
            return packed_micro_batch(batch, rows, fill={"token_temperature": self.temperature})
        return trimmed_micro_batch(batch, rows, prompt_lens)

    def _step_totals(self, loss_mask: torch.Tensor, plan: MicroBatchPlan) -> tuple[list[float], list[float]]:
        """Per micro-batch: the rows and loss tokens of its optimizer step, over all processes (exact when
        steps_per_generation is a multiple of gradient_accumulation_steps; else TRL's even share)."""
        local = [[float(len(p)), float(loss_mask[p].sum()) if p else 0.0] for p in plan.micro]
        totals = self.accelerator.reduce(
            torch.tensor(local, device=loss_mask.device), reduction="sum"
        ).tolist()
        count, per_step = len(totals), self.args.gradient_accumulation_steps
        if count % per_step:
            rows, tokens = (sum(t[k] for t in totals) * per_step / count for k in (0, 1))
            return [rows] * count, [tokens] * count
        steps = [
            [sum(t[k] for t in totals[s : s + per_step]) for k in (0, 1)] for s in range(0, count, per_step)
        ]
        return [steps[j // per_step][0] for j in range(count)], [
            steps[j // per_step][1] for j in range(count)
        ]

    def _weigh_for_micro_batches(
        self, advantages: torch.Tensor, loss_mask: torch.Tensor, plan: MicroBatchPlan
    ) -> torch.Tensor:
        """Make each loss's normaliser the optimizer step's, whatever the micro-batches hold: TRL's num_items_in_batch
        for token-sum losses, and for losses TRL averages per micro-batch (per row: grpo, sapo, luspo, dr_grpo; per
        token: bnpo) a weight on the advantage (which TRL's objectives are linear in; the KL term keeps TRL's)."""
        step_rows, step_tokens = self._step_totals(loss_mask, plan)
        count, per_step = len(plan.micro), self.args.gradient_accumulation_steps
        plan.num_items = [step_tokens[j] * count / per_step for j in range(count)]
        if self.loss_type not in ROW_AVERAGED_LOSSES + TOKEN_AVERAGED_LOSSES:
            return advantages
        scale = per_step * self.accelerator.num_processes
        weights = torch.ones(loss_mask.size(0), device=loss_mask.device)
        for j, rows in enumerate(plan.micro):
            if rows and self.loss_type in ROW_AVERAGED_LOSSES:
                weights[rows] = len(rows) * scale / max(step_rows[j], 1.0)
            elif rows:
                weights[rows] = float(loss_mask[rows].sum()) * scale / max(step_tokens[j], 1.0)
        return advantages * (weights.unsqueeze(1) if advantages.dim() == 2 else weights)

    def _split_micro_batches(self, scored: dict[str, Any]) -> list[dict[str, Any]]:
        """A scored generation batch as its planned micro-batches (a filler where a micro-batch has no row)."""
        plan: MicroBatchPlan = scored.pop(MICRO_BATCH_PLAN)
        prompt_lens = scored.pop("prompt_lens").tolist()
        shortest = min(range(len(plan.lengths)), key=lambda i: plan.lengths[i])
        micro_batches = []
        for j, rows in enumerate(plan.micro):
            micro = self._micro_batch(scored, rows or [shortest], prompt_lens, plan.packed)
            micro = micro if rows else as_filler(micro)
            if plan.num_items:
                micro["num_items_in_batch"] = torch.tensor(plan.num_items[j], device=self.accelerator.device)
            micro_batches.append(micro)
        return micro_batches

    @contextmanager
    def _packed_rows(self, position_ids: torch.Tensor | None) -> Iterator[None]:
        """Forward passes inside score a packed row with these position ids (None: padded rows)."""
        previous, self._packed_position_ids = self._packed_position_ids, position_ids
        try:
            yield
        finally:
            self._packed_position_ids = previous

    # -- pieces ----------------------------------------------------------------------------------------------------

    def _stale_importance_weights(
        self,
        current: torch.Tensor,
        behaviour: torch.Tensor,
        mask: torch.Tensor,
        stale: torch.Tensor,
        mode: str,
    ) -> torch.Tensor:
        """pi_current / pi_behaviour per token (or per sequence), truncated or masked; 1 for fresh rollouts."""
        correction = self.args.stale_correction
        log_ratio = ((current - behaviour) * mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if correction.startswith("sequence"):
            log_ratio = (log_ratio.sum(-1, keepdim=True)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        low = self.args.stale_is_clip_min if self.args.stale_is_clip_min is not None else 0.0
        high = self.args.stale_is_clip_max
        if correction.endswith("truncate"):
            weights = ratio.clamp(min=low, max=high)
        else:
            weights = torch.where((ratio > high) | (ratio < low), torch.zeros_like(ratio), ratio)
        weights = (
            torch.where(stale.unsqueeze(1), weights, torch.ones_like(weights)).expand_as(mask).contiguous()
        )

        token_mask = (mask.bool() & stale.unsqueeze(1)) if ratio.size(1) > 1 else stale.unsqueeze(1)
        raw = self._gather_values(ratio[token_mask])
        used = self._gather_values((weights if ratio.size(1) > 1 else weights[:, :1])[token_mask])
        if raw.numel():
            metrics = self._metrics[mode]
            metrics["importance_ratio/mean"].append(raw.mean().item())
            metrics["importance_ratio/min"].append(raw.min().item())
            metrics["importance_ratio/max"].append(raw.max().item())
            metrics["importance_weight/mean"].append(used.mean().item())
            metrics["importance_weight/frac_corrected"].append((used != raw).float().mean().item())
        return weights

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

    def _gather_values(self, values: torch.Tensor) -> torch.Tensor:
        """Every process's values of a ragged 1-D tensor."""
        values = values.detach().float().reshape(-1)
        padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=math.nan)
        gathered = self.accelerator.gather(padded)
        return gathered[~torch.isnan(gathered)]

    def _log_batch_metrics(
        self,
        mode: str,
        batch: dict[str, torch.Tensor],
        staleness: torch.Tensor,
        plan: MicroBatchPlan,
        rows: list[dict[str, Any]],
    ) -> None:
        """Per generation batch (per optimizer step, with TRL's default steps_per_generation): rewards, advantages,
        staleness, and what the step holds — groups, rows, tokens, loss tokens — with the padding its micro-batches
        computed."""
        from accelerate.utils import gather_object

        metrics = self._metrics[mode]
        real = ~batch["placeholder"]  # a placeholder stands in only where a process got no row: no data
        loss_mask = batch["loss_mask"]
        rewards = self._gather_values(batch["rewards"][real])
        advantages = self._gather_values(batch["advantages"][real])
        stale_values = self._gather_values(staleness[real])
        sampled = self._gather_values(loss_mask[real].sum(-1))
        real_tokens, computed = plan.grid()
        local = [float(real_tokens), float(computed), float(real.sum()), float(loss_mask[real].sum())]
        totals = self.accelerator.reduce(
            torch.tensor(local, device=loss_mask.device), reduction="sum"
        ).tolist()
        groups = {group_key(row) for row in rows if not row.get("placeholder")}
        if mode == "train":
            self.state.num_input_tokens_seen += int(totals[0])
        metrics["num_tokens"] = [self.state.num_input_tokens_seen]
        metrics["reward"].append(rewards.mean().item())
        metrics["reward_std"].append(rewards.std().item() if rewards.numel() > 1 else 0.0)
        metrics["advantages/mean"].append(advantages.mean().item())
        metrics["advantages/std"].append(advantages.std().item() if advantages.numel() > 1 else 0.0)
        metrics["advantages/min"].append(advantages.min().item())
        metrics["advantages/max"].append(advantages.max().item())
        metrics["advantages/frac_zero"].append((advantages == 0).float().mean().item())
        metrics["staleness/mean"].append(stale_values.mean().item())
        metrics["staleness/max"].append(stale_values.max().item())
        metrics["staleness/frac_stale"].append((stale_values > 0).float().mean().item())
        metrics["completions/mean_sampled_tokens"].append(sampled.mean().item())
        metrics["batch/groups"].append(float(len(set(gather_object(sorted(groups))))))
        metrics["batch/rows"].append(totals[2])
        metrics["batch/tokens"].append(totals[0])
        metrics["batch/loss_tokens"].append(totals[3])
        metrics["padding_fraction"].append(1.0 - totals[0] / totals[1] if totals[1] else 0.0)

    # -- saving ----------------------------------------------------------------------------------------------------

    def save_for_engine(self, output_dir: str | Path) -> Path:
        """Write a full Hugging Face checkpoint an engine can load: the weights (LoRA merged in) in `write_dtype` —
        a bf16 model stays bf16 even when trained in fp32 — the tokenizer, and the model metadata polar-mitm's
        engine reads."""
        output_dir = Path(output_dir)
        main = self.accelerator.is_main_process
        model = self.accelerator.unwrap_model(self.model)
        dtype = write_dtype(model.dtype, self.model_source)
        if self.is_peft:
            if main:
                merged = copy.deepcopy(model).merge_and_unload().to(dtype)
                merged.save_pretrained(output_dir)
                self.processing_class.save_pretrained(output_dir)
            self.accelerator.wait_for_everyone()
        elif dtype == model.dtype:
            self.save_model(str(output_dir))
        else:
            weights = self.accelerator.get_state_dict(self.model)  # collective under ZeRO-3 / FSDP
            if main:
                self._save(str(output_dir), state_dict={k: v.to(dtype) for k, v in weights.items()})
            self.accelerator.wait_for_everyone()
        if main:
            set_checkpoint_dtype(output_dir, dtype)
            self._copy_model_metadata(output_dir)
        return output_dir

    def save_final(self) -> dict[str, Path]:
        """Save the trained model to output_dir (full weights in the training dtype — the copy a next training
        continues from — or LoRA adapters plus `merged/` when asked); with `run_state_dir`, the optimizer too."""
        output_dir = Path(self.args.output_dir)
        self.save_model(str(output_dir))
        saved = {"model": output_dir}
        if self.accelerator.is_main_process:
            self._copy_model_metadata(output_dir)
        if self.is_peft and self.args.save_merged:
            saved["merged"] = self.save_for_engine(output_dir / "merged")
        if self.args.run_state_dir:
            saved["run_state"] = self.save_run_state()
        return saved

    @property
    def is_peft(self) -> bool:
        return is_peft_model(self.accelerator.unwrap_model(self.model))

    def _copy_model_metadata(self, output_dir: Path) -> None:
        if self.model_source is None:
            return
        for name in MODEL_METADATA_FILES:
            src = self.model_source / name
            if src.exists() and not (output_dir / name).exists():
                shutil.copy2(src, output_dir / name)
