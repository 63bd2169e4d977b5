"""The step-0 behaviour check: do the recorded logprobs match the weights that sampled them?

TRL's clipped ratio here is pi_theta / pi_behaviour with the engine's recorded logprobs as pi_behaviour, so a wrong
temperature, wrong weights or wrong tokens in a recording would silently become a gradient. Before the first step,
`BehaviourCheckMixin` scores every row the starting weights sampled (a stale row was sampled by other weights) and
compares, per row: the mean |recomputed - recorded| over its sampled tokens, and how many of them have a ratio over
the fresh-row cap. The result goes to `behaviour_check.json` and the log, into every step's metrics
(`logp_diff/*`, `off_policy/*`), and, with `drop_mismatched_rows`, takes the rows over the tolerance out of the loss.
A resume restores the check instead of re-running it against trained weights (train/continuation.py).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from polar_mitm.train.scoring import disable_gradient_checkpointing
from polar_mitm.train.stats import version_distance

logger = logging.getLogger(__name__)

BEHAVIOUR_CHECK_FILE = "behaviour_check.json"
WORST_ROWS_REPORTED = 20


class BehaviourCheckMixin:
    """`PolarGRPOTrainer`'s step-0 check, run on the first generation batch (`_behaviour_check_values`); its per-row
    results are `behaviour_logp_diff` and `behaviour_ratio_excess`, which a checkpoint saves."""

    behaviour_logp_diff: dict[int, float] | None  # row → mean |recomputed - recorded|, at step 0
    # row → (sampled tokens whose step-0 ratio trainer/engine exceeds the fresh-row cap, sampled tokens, max log ratio)
    behaviour_ratio_excess: dict[int, tuple[int, int, float]]

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
