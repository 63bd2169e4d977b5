"""What the trainer reports beyond TRL's metrics: about each generation batch, and about the data at the start.

TRL's metrics describe the loss; these describe what it was computed on, which varies far more with recorded
rollouts than with TRL's own generations: the batch's rewards and advantages, how stale its rows are, how many
groups, rows, tokens and loss tokens an optimizer step holds and how much padding its micro-batches computed
(`_log_batch_metrics`; the advantages per session and per loss token, `_log_advantages`); and at the start, what
the data left out of the loss and how sessions are weighed (`_log_data_summary`). Values are gathered over the
processes (`_gather_values`), so every rank logs the same.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from polar_mitm.train.batching import MicroBatchPlan, group_key
from polar_mitm.train.grpo_config import PER_SEQUENCE_LOSSES

logger = logging.getLogger(__name__)


class TrainerMetricsMixin:
    """`PolarGRPOTrainer`'s metrics (into TRL's `_metrics`, which reach metrics.jsonl) and start-of-run log."""

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
        # per sampled token (a row's tokens may come from several weight versions)
        stale_values = self._gather_values(staleness[real][loss_mask[real].bool()])
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
        self._log_advantages(metrics, batch, rows)
        if stale_values.numel():
            metrics["staleness/mean"].append(stale_values.float().mean().item())
            metrics["staleness/max"].append(stale_values.max().item())
            metrics["staleness/frac_stale"].append((stale_values > 0).float().mean().item())
        metrics["completions/mean_sampled_tokens"].append(sampled.mean().item())
        metrics["batch/groups"].append(float(len(set(gather_object(sorted(groups))))))
        metrics["batch/rows"].append(totals[2])
        metrics["batch/tokens"].append(totals[0])
        metrics["batch/loss_tokens"].append(totals[3])
        metrics["padding_fraction"].append(1.0 - totals[0] / totals[1] if totals[1] else 0.0)

    def _log_advantages(self, metrics, batch: dict[str, torch.Tensor], rows: list[dict[str, Any]]) -> None:
        """The step's advantages per session (each session once, however many sequences it has: the mean is 0 when
        the step holds whole groups) and per loss token (`advantages/token_mean`: the direction a token-level loss
        pushes in, which long failures tilt negative)."""
        from accelerate.utils import gather_object

        real = ~batch["placeholder"]
        advantage, tokens = batch["advantages"][real].tolist(), batch["loss_mask"][real].sum(-1).tolist()
        sessions = [row["session_id"] for row in rows if not row.get("placeholder")]
        pairs = gather_object([(s, a, n) for s, a, n in zip(sessions, advantage, tokens, strict=True)])
        per_session = {session: a for session, a, _ in pairs}
        values = torch.tensor(list(per_session.values()) or [0.0], dtype=torch.float64)
        token_count = sum(n for _, _, n in pairs)
        metrics["advantages/mean"].append(values.mean().item())
        metrics["advantages/std"].append(values.std().item() if values.numel() > 1 else 0.0)
        metrics["advantages/min"].append(values.min().item())
        metrics["advantages/max"].append(values.max().item())
        metrics["advantages/frac_zero"].append((values == 0).double().mean().item())
        metrics["advantages/token_mean"].append(
            sum(a * n for _, a, n in pairs) / token_count if token_count else 0.0
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
