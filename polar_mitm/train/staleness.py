"""Rollouts older than the policy being trained: weight versions, and the decoupled correction of stale rows.

The loop trains on rollouts sampled while earlier weights were served, and every optimizer step moves the weights
one version on, so a row's recorded behaviour logprobs may come from a policy some updates old. `StaleRolloutMixin`
counts the versions (`policy_weight_version`, `staleness`) and, with `stale_correction`, anchors TRL's clipped ratio
of a stale token on the current weights' logprobs instead, weighting it (or its sequence) by
pi_current / pi_behaviour, truncated (TIS) or masked at `stale_is_clip_max`. Fresh tokens keep the recorded logprobs
as the anchor.

Staleness is per token, from the version of the span of sampled tokens it belongs to (merged `span_starts` /
`span_versions`: a push may land between two tokens of one call), so a call half sampled by the weights being
trained is only half stale; `max_staleness` masks the tokens older than K versions.
"""

from __future__ import annotations

from typing import Any

import torch

from polar_mitm.train.batching import MicroBatchPlan
from polar_mitm.train.stats import advanced_version, version_distance

LOG_RATIO_CLAMP = 20.0  # exp(±20) keeps sequence-level weights finite


class StaleRolloutMixin:
    """`PolarGRPOTrainer`'s weight versions (from `base_weight_version`, set at init) and stale-row correction."""

    base_weight_version: str | None

    def policy_weight_version(self) -> str:
        """The version of the weights being trained: the starting version plus one per optimizer step."""
        return advanced_version(self.base_weight_version, self.state.global_step)

    def staleness(self, recorded_version: str | None) -> int:
        """Weight updates between the weights that sampled a rollout and the weights now being trained."""
        return version_distance(self.base_weight_version, recorded_version) + self.state.global_step

    def _token_staleness(self, inputs: list[dict[str, Any]], width: int, device) -> torch.Tensor:
        """[B, width] per completion token of a generation batch (collated: split at the batch's shortest
        prompt_len): the staleness of the version that sampled it (0: the weights being trained). Tokens before a
        row's first span (its context) take the first span's; rows without spans, their `weight_version`'s."""
        split = min(int(row["prompt_len"]) for row in inputs)
        out = torch.zeros((len(inputs), width), dtype=torch.long)
        for i, row in enumerate(inputs):
            starts = row.get("span_starts") or [int(row["prompt_len"])]
            versions = row.get("span_versions") or [row.get("weight_version")]
            ends = [*starts[1:], split + width]
            for k, (start, end, version) in enumerate(zip(starts, ends, versions, strict=True)):
                begin = 0 if k == 0 else max(int(start) - split, 0)
                out[i, begin : max(int(end) - split, 0)] = self.staleness(version)
        return out.to(device)

    def _mask_too_stale(self, loss_mask: torch.Tensor, staleness: torch.Tensor, mode: str) -> torch.Tensor:
        """`loss_mask` without the sampled tokens more than `max_staleness` versions old (counted in the metrics)."""
        limit = self.args.max_staleness
        if limit is None:
            return loss_mask
        too_stale = (staleness > limit) & loss_mask.bool()
        masked = self.accelerator.reduce(too_stale.sum().float().reshape(1), reduction="sum").item()
        self._metrics[mode]["staleness/masked_tokens"].append(masked)
        return loss_mask * ~too_stale

    def _correct_stale_rows(
        self,
        batch: dict[str, Any],
        plan: MicroBatchPlan,
        prompt_lens: list[int],
        loss_mask: torch.Tensor,
        advantages: torch.Tensor,
        staleness: torch.Tensor,
        mode: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The ratio anchor, the advantages and the importance weights of a generation batch (inside
        `torch.no_grad`): fresh rows keep the recorded behaviour logprobs; with `stale_correction`, stale rows are
        anchored on the current weights' logprobs and their advantages weighted by the truncated (or masked)
        pi_current / pi_behaviour — the weights ([B, W], 1 on fresh tokens; None: none corrected), which the KL
        term takes too (train/kl.py). `staleness` is per token ([B, W])."""
        behaviour_logps = batch["behaviour_logps"]
        stale = (staleness > 0) & loss_mask.bool()
        # Decided across processes: a forward pass under ZeRO-3/FSDP is collective, so all ranks run it or none does.
        any_stale = self.accelerator.gather(stale.any().float().reshape(1)).max().item() > 0
        if self.args.stale_correction == "none" or not any_stale:
            return behaviour_logps, advantages, None
        current_logps = self._planned_logps(batch, plan, prompt_lens, self._policy_forward)
        weights = self._stale_importance_weights(current_logps, behaviour_logps, loss_mask, stale, mode)
        old_per_token_logps = torch.where(stale, current_logps, behaviour_logps)
        # A non-negative weight on the advantage is the weight on the token's loss: TRL's clipped objective is linear
        # in A, and the sign (which the clip metrics read) is kept.
        advantages = advantages.unsqueeze(1) * weights if advantages.dim() == 1 else advantages * weights
        return old_per_token_logps, advantages, weights

    def _stale_importance_weights(
        self,
        current: torch.Tensor,
        behaviour: torch.Tensor,
        mask: torch.Tensor,
        stale: torch.Tensor,
        mode: str,
    ) -> torch.Tensor:
        """pi_current / pi_behaviour per stale token (or per sequence, over its stale tokens), truncated or masked;
        1 for fresh tokens (a sequence's weight, for every token of a sequence with a stale one). `stale` is the
        [B, W] stale sampled tokens."""
        correction = self.args.stale_correction
        log_ratio = ((current - behaviour) * stale).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if correction.startswith("sequence"):
            log_ratio = (log_ratio.sum(-1, keepdim=True)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            stale = stale.any(-1, keepdim=True)
        ratio = torch.exp(log_ratio)
        low = self.args.stale_is_clip_min if self.args.stale_is_clip_min is not None else 0.0
        high = self.args.stale_is_clip_max
        if correction.endswith("truncate"):
            weights = ratio.clamp(min=low, max=high)
        else:
            weights = torch.where((ratio > high) | (ratio < low), torch.zeros_like(ratio), ratio)
        weights = torch.where(stale, weights, torch.ones_like(weights))
        raw = self._gather_values(ratio[stale])
        used = self._gather_values(weights[stale])
        weights = weights.expand_as(mask).contiguous()
        if raw.numel():
            metrics = self._metrics[mode]
            metrics["importance_ratio/mean"].append(raw.mean().item())
            metrics["importance_ratio/min"].append(raw.min().item())
            metrics["importance_ratio/max"].append(raw.max().item())
            metrics["importance_weight/mean"].append(used.mean().item())
            metrics["importance_weight/frac_corrected"].append((used != raw).float().mean().item())
            # The trust region of stale rows (with num_iterations 1 their PPO ratio is 1, so PPO's clip never acts):
            # how many of their tokens (sequences) sit at the cap, or are masked above it.
            capped = (raw > high).float().sum().item()
            metrics["importance_weight/stale_tokens"].append(float(raw.numel()))
            metrics["importance_weight/capped_tokens"].append(capped)
            metrics["importance_weight/frac_capped"].append(capped / raw.numel())
        return weights
