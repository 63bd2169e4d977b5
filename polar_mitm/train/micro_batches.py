"""The trainer's batches: whole task groups per optimizer step, each micro-batch cut to its own rows.

`batching.py` plans which rows share an optimizer step (whole groups, so every step's advantages have their
baseline; zero-advantage groups left out) and `packing.py` lays a micro-batch out (trimmed to its rows, or packed
into one row). `MicroBatchMixin` is the trainer's side of both: TRL's sampler replaced by `GroupBatchSampler`
(`_get_train_sampler`); the scored generation batch cut into the planned micro-batches instead of TRL's shuffled
equal splits at the batch's full width (`_prepare_inputs`); and forward passes over a packed row (`compute_loss`,
`_planned_logps`). What each loss then divides by, whatever its micro-batches hold, is normalisers.py's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from polar_mitm.train.batching import (
    BatchPlan,
    BatchShape,
    GroupBatchSampler,
    MicroBatchPlan,
    plan_batches,
    plan_micro_batches,
)
from polar_mitm.train.packing import (
    PROMPT_KEYS,
    as_filler,
    attention_refusal,
    packed_micro_batch,
    packing_refusal,
    scatter_micro_batch,
    trimmed_micro_batch,
    use_segment_attention,
)

logger = logging.getLogger(__name__)

MICRO_BATCH_PLAN = "micro_batch_plan"  # the scored batch's MicroBatchPlan, cut by _split_micro_batches


class MicroBatchMixin:
    """`PolarGRPOTrainer`'s batches (listed before TRL's `GRPOTrainer`, whose `_get_train_sampler`,
    `_prepare_inputs` and `compute_loss` it replaces or extends)."""

    _batch_plan: BatchPlan | None = None  # built on first use (batch_plan)
    _packs: bool | None = None  # decided on first use (packs_micro_batches)
    _packed_position_ids: torch.Tensor | None = None  # the packed row being scored (_packed_rows)

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
