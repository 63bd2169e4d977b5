"""`PolarGRPOTrainer`: TRL's GRPO trainer fed with recorded rollouts instead of its own generations.

Two TRL methods are overridden (pinned to trl==1.16.0, whose internals they follow):

- `_get_train_sampler`: length-bucketed generation batches instead of prompt repeats (groups are formed by task_id
  before training, so the sampler needs no grouping);
- `_generate_and_score_completions`: instead of sampling, pad recorded rows into TRL's batch: prompt/completion ids
  and masks, `tool_mask` = our loss mask (1 = a token the engine sampled), the precomputed advantages, and
  `old_per_token_logps` = the recorded behaviour logprobs — so TRL's clipped ratio is pi_theta / pi_behaviour.
  Rollouts older than the current policy get the decoupled correction: the ratio is anchored on the current
  weights' logprobs and each token is weighted by pi_current / pi_behaviour, truncated (TIS).

Everything else — the loss types, clipping, KL to a reference, PEFT, gradient accumulation, multi-process
training through accelerate, logging — is TRL's.
"""

from __future__ import annotations

import copy
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from polar_mitm.train.data import (
    LengthBucketSampler,
    TrainingData,
    collate,
    newest_weight_version,
    version_distance,
)
from polar_mitm.train.grpo_config import PolarGRPOConfig

logger = logging.getLogger(__name__)

LOG_RATIO_CLAMP = 20.0  # exp(±20) keeps sequence-level weights finite
MODEL_METADATA_FILES = ("polar_model.json",)  # tells `polar-mitm serve` which parsers the model family uses


def recorded_reward(completions: list[Any], reward: list[float] | None = None, **_: Any) -> list[float]:
    """The reward joined into the merged shards. TRL requires a reward source; the recorded rows carry theirs."""
    return [float(r) for r in reward or []]


class PolarGRPOTrainer(GRPOTrainer):
    """GRPO on merged sequences (MERGED_SCHEMA): the loss only on sampled tokens, ratios against behaviour logprobs.

    Args:
        model: a checkpoint directory or a loaded causal LM (as for TRL's `GRPOTrainer`).
        args: a `PolarGRPOConfig`.
        train_data: rows from `polar_mitm.train.data.build_training_data` (advantages already computed).
        processing_class: the tokenizer (loaded from `model` when omitted); only its pad id is used.
        callbacks: extra `TrainerCallback`s.
        peft_config: a PEFT config (e.g. `LoraConfig`) to train adapters instead of all weights.
    """

    _tag_names = ["trl", "grpo", "polar-mitm"]
    _name = "Polar GRPO"

    def __init__(self, model, args: PolarGRPOConfig, train_data: TrainingData, processing_class=None,
                 callbacks=None, peft_config=None) -> None:
        if args.strict_group_size and train_data.stats.group_size_mismatches:
            raise ValueError(f"{train_data.stats.group_size_mismatches} groups do not have {args.group_size} "
                             f"sessions (sizes: {train_data.stats.group_sizes})")
        self.train_data = train_data
        self.model_source = Path(model) if isinstance(model, str | Path) else None
        super().__init__(model=str(model) if isinstance(model, Path) else model, reward_funcs=recorded_reward,
                         args=args, train_dataset=train_data.to_dataset(), processing_class=processing_class,
                         callbacks=callbacks, peft_config=peft_config)
        self.base_weight_version = args.policy_weight_version or newest_weight_version(train_data.rows)
        from polar_mitm.train.metrics import JsonlMetricsCallback

        self.add_callback(JsonlMetricsCallback(Path(args.output_dir) / args.metrics_file))
        if args.push_to_engine:
            from polar_mitm.train.sync import EnginePushCallback

            self.add_callback(EnginePushCallback(self))

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

    def _get_train_sampler(self, dataset=None) -> LengthBucketSampler:
        return LengthBucketSampler(
            self.train_data.lengths(),
            batch_size=self.args.generation_batch_size,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            shuffle=bool(self.shuffle_dataset),
            seed=self.args.seed,
        )

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        device = self.accelerator.device
        mode = "train" if self.model.training else "eval"
        pad_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        batch = {k: v.to(device) for k, v in collate(inputs, pad_token_id=pad_id).items()}
        prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
        completion_mask, loss_mask = batch["completion_mask"], batch["loss_mask"]
        behaviour_logps, advantages = batch["behaviour_logps"], batch["advantages"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        forward_batch = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size

        staleness = torch.tensor([self.staleness(row.get("weight_version")) for row in inputs], device=device)
        stale = staleness > 0
        # Decided across processes: a forward pass under ZeRO-3/FSDP is collective, so all ranks run it or none does.
        any_stale = self.accelerator.gather(stale.any().float().reshape(1)).max().item() > 0
        old_per_token_logps = behaviour_logps
        current_logps = None
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            correct = self.args.stale_correction != "none" and any_stale
            if correct or self.args.check_behaviour_logps:
                current_logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, logits_to_keep, batch_size=forward_batch)
            if correct:
                weights = self._stale_importance_weights(current_logps, behaviour_logps, loss_mask, stale, mode)
                anchor_current = stale.unsqueeze(1) & loss_mask.bool()
                old_per_token_logps = torch.where(anchor_current, current_logps, behaviour_logps)
                # A non-negative weight on the advantage is the weight on the token's loss: TRL's clipped objective
                # is linear in A, and the sign (which the clip metrics read) is kept.
                advantages = advantages.unsqueeze(1) * weights
            ref_per_token_logps = self._reference_logps(input_ids, attention_mask, logits_to_keep, forward_batch)

        num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()
        self._log_batch_metrics(mode, batch, staleness, current_logps, stale)
        output = {
            "prompt_ids": prompt_ids,
            "prompt_mask": batch["prompt_mask"],
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "tool_mask": loss_mask,
            "advantages": advantages,
            "num_items_in_batch": num_items_in_batch,
            "old_per_token_logps": old_per_token_logps,
            "sampling_per_token_logps": behaviour_logps,
        }
        if ref_per_token_logps is not None:
            output["ref_per_token_logps"] = ref_per_token_logps
        return output

    # -- pieces ----------------------------------------------------------------------------------------------------

    def _stale_importance_weights(self, current: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                                  stale: torch.Tensor, mode: str) -> torch.Tensor:
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
        weights = torch.where(stale.unsqueeze(1), weights, torch.ones_like(weights)).expand_as(mask).contiguous()

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

    def _reference_logps(self, input_ids, attention_mask, logits_to_keep, forward_batch) -> torch.Tensor | None:
        """Logprobs under the reference model (beta > 0): TRL's ref model, or the base model under a LoRA."""
        if self.beta == 0.0:
            return None
        if self.ref_model is not None:
            return self._get_per_token_logps_and_entropies(
                self.ref_model, input_ids, attention_mask, logits_to_keep, batch_size=forward_batch)[0]
        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, logits_to_keep, batch_size=forward_batch)[0]

    def _gather_values(self, values: torch.Tensor) -> torch.Tensor:
        """Every process's values of a ragged 1-D tensor."""
        values = values.detach().float().reshape(-1)
        padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=math.nan)
        gathered = self.accelerator.gather(padded)
        return gathered[~torch.isnan(gathered)]

    def _log_batch_metrics(self, mode: str, batch: dict[str, torch.Tensor], staleness: torch.Tensor,
                           current_logps: torch.Tensor | None, stale: torch.Tensor) -> None:
        metrics = self._metrics[mode]
        loss_mask, completion_mask = batch["loss_mask"], batch["completion_mask"]
        rewards = self._gather_values(batch["rewards"])
        advantages = self._gather_values(batch["advantages"])
        stale_values = self._gather_values(staleness)
        sampled = self._gather_values(loss_mask.sum(-1))
        real = batch["prompt_mask"].sum() + completion_mask.sum()
        grid = batch["prompt_mask"].numel() + completion_mask.numel()
        totals = self.accelerator.reduce(torch.stack([real.float(), torch.tensor(float(grid), device=real.device)]),
                                         reduction="sum")
        if mode == "train":
            self.state.num_input_tokens_seen += int(totals[0].item())
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
        metrics["padding_fraction"].append(1.0 - (totals[0] / totals[1]).item())
        if current_logps is not None:
            fresh = loss_mask.bool() & ~stale.unsqueeze(1)
            diff = self._gather_values((current_logps - batch["behaviour_logps"]).abs()[fresh])
            if diff.numel():  # recorded vs recomputed logprobs of fresh rollouts: an alignment check
                metrics["logp_diff/fresh_mean"].append(diff.mean().item())
                metrics["logp_diff/fresh_max"].append(diff.max().item())

    # -- saving ----------------------------------------------------------------------------------------------------

    def save_for_engine(self, output_dir: str | Path) -> Path:
        """Write a full Hugging Face checkpoint an engine can load: the weights (LoRA merged in), the tokenizer, and
        the model metadata polar-mitm's engine reads."""
        output_dir = Path(output_dir)
        if self.is_peft:
            if self.accelerator.is_main_process:
                merged = copy.deepcopy(self.accelerator.unwrap_model(self.model)).merge_and_unload()
                merged.save_pretrained(output_dir)
                self.processing_class.save_pretrained(output_dir)
            self.accelerator.wait_for_everyone()
        else:
            self.save_model(str(output_dir))
        if self.accelerator.is_main_process:
            self._copy_model_metadata(output_dir)
        return output_dir

    def save_final(self) -> dict[str, Path]:
        """Save the trained model to output_dir (full weights, or LoRA adapters plus `merged/` when asked)."""
        output_dir = Path(self.args.output_dir)
        self.save_model(str(output_dir))
        saved = {"model": output_dir}
        if self.accelerator.is_main_process:
            self._copy_model_metadata(output_dir)
        if self.is_peft and self.args.save_merged:
            saved["merged"] = self.save_for_engine(output_dir / "merged")
        return saved

    @property
    def is_peft(self) -> bool:
        from accelerate.utils import is_peft_model

        return is_peft_model(self.accelerator.unwrap_model(self.model))

    def _copy_model_metadata(self, output_dir: Path) -> None:
        if self.model_source is None:
            return
        for name in MODEL_METADATA_FILES:
            src = self.model_source / name
            if src.exists() and not (output_dir / name).exists():
                shutil.copy2(src, output_dir / name)
