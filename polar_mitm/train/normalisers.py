"""What each loss divides by: the optimizer step's normaliser whatever its micro-batches hold, and the two that are
constants of the run.

Micro-batches differ in rows and tokens (whole groups per step, each micro-batch trimmed or packed), so the losses
TRL normalises per micro-batch would weigh a row by the micro-batch it landed in. `_weigh_for_micro_batches` makes
every normaliser the step's over all processes: TRL's `num_items_in_batch` for the token-sum losses (dapo, cispo,
vespo), and a weight on each row's advantage for the losses TRL averages per micro-batch (per row: grpo, sapo,
luspo, dr_grpo; per token: bnpo) — TRL's objectives are linear in the advantage. It also gives every row the weight
its tokens have in the policy term (`row_token_weight`), which the KL term (train/kl.py) uses, so both terms share
one normaliser.

Two normalisers do not follow the step:

- **dr_grpo** divides a step's token sum by L × the step's row capacity (per-device batch × processes ×
  accumulation steps), L the completion budget (`dr_grpo_constant`). Dr. GRPO's constant is the generation's
  max length; recorded rollouts have none, and TRL's fallback (the data's longest sequence, prompt and tool outputs
  included) changed with every training. L defaults to the most loss tokens of a row in the run's first training.
- **token_normaliser=run** divides the token-level losses (dapo, bnpo, cispo, vespo) by a constant of the run, the
  expected loss tokens per step (`loss_tokens_per_step`; default: the first training's loss tokens / its steps),
  instead of each step's own loss tokens. Steps hold length-sorted groups, so per step the weight of a token
  differs between steps by the ratio of their loss tokens.

Both constants are kept in run_state_dir's `RunState` (train/continuation.py) by the first training that uses them;
every later training of the run reads them back. `batch/loss_normaliser` logs what each step divided by.
"""

from __future__ import annotations

import logging

import torch

from polar_mitm.train.batching import MicroBatchPlan
from polar_mitm.train.grpo_config import PER_SEQUENCE_LOSSES

logger = logging.getLogger(__name__)

# Losses TRL normalises per micro-batch: by its rows, or by its loss tokens (the rest: by num_items_in_batch).
ROW_AVERAGED_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")
TOKEN_AVERAGED_LOSSES = ("bnpo",)
TOKEN_LEVEL_LOSSES = ("dapo", "bnpo", "cispo", "vespo")  # those token_normaliser applies to


def longest_loss_tokens(rows: list[dict]) -> int:
    """The most loss tokens of a row (Dr. GRPO's completion budget, when none is given)."""
    return max((sum(1 for m in row["loss_mask"] if m) for row in rows), default=1)


class LossNormaliserMixin:
    """`PolarGRPOTrainer`'s loss normalisers (listed before TRL's `GRPOTrainer`)."""

    dr_grpo_constant: int | None = None
    loss_tokens_per_step: float | None = None  # token_normaliser=run's constant; None: each step's own tokens

    def _init_normalisers(self) -> None:
        """The run's constants: given, recorded by an earlier training of the run, or fixed now from the data (and
        recorded in the run state this training saves)."""
        state, args = self.run_state, self.args
        if self.loss_type == "dr_grpo":
            source = "given" if args.dr_grpo_constant else "recorded" if state.dr_grpo_constant else "data"
            self.dr_grpo_constant = (
                args.dr_grpo_constant or state.dr_grpo_constant or longest_loss_tokens(self.train_data.rows)
            )
            state.dr_grpo_constant = self.max_completion_length = self.dr_grpo_constant
            logger.info(
                "dr_grpo: each step's token losses / (%d rows x L = %d loss tokens, %s)",
                self.step_row_capacity(),
                self.dr_grpo_constant,
                {"given": "dr_grpo_constant", "recorded": "the run's", "data": "this data's longest"}[source],
            )
        if args.token_normaliser == "run" and self.loss_type in TOKEN_LEVEL_LOSSES:
            constant = args.loss_tokens_per_step or state.loss_tokens_per_step or self._expected_loss_tokens()
            self.loss_tokens_per_step = state.loss_tokens_per_step = float(constant)
            logger.info(
                "%s: each step's token losses / %.1f loss tokens (the run's constant)",
                self.loss_type,
                constant,
            )

    def step_row_capacity(self) -> int:
        """Rows an optimizer step holds when full: per-device batch × processes × accumulation steps."""
        args = self.args
        return (
            args.per_device_train_batch_size
            * self.accelerator.num_processes
            * args.gradient_accumulation_steps
        )

    def _expected_loss_tokens(self) -> float:
        """This training's loss tokens per optimizer step, on average over its batch plan."""
        plan, shape = self.batch_plan(), self._batch_shape()
        tokens = sum(sum(1 for m in self.train_data.rows[i]["loss_mask"] if m) for i in plan.rows())
        steps = len(plan.chunks) * shape.micro_per_chunk / shape.accumulation_steps
        return max(tokens / max(steps, 1.0), 1.0)

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

    def step_normalisers(
        self, loss_mask: torch.Tensor, plan: MicroBatchPlan
    ) -> tuple[list[float], list[float]]:
        """Per micro-batch: the rows and the loss tokens its step's loss divides by (the run's constants where they
        replace the step's own)."""
        step_rows, step_tokens = self._step_totals(loss_mask, plan)
        if self.loss_tokens_per_step is not None:
            step_tokens = [self.loss_tokens_per_step] * len(step_tokens)
        if self.loss_type == "dr_grpo":
            step_rows = [float(self.step_row_capacity())] * len(step_rows)
        return step_rows, step_tokens

    def _weigh_for_micro_batches(
        self,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        plan: MicroBatchPlan,
        session_weight: torch.Tensor,
        mode: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Make each loss's normaliser the optimizer step's (or the run's constant), whatever the micro-batches hold:
        TRL's num_items_in_batch for token-sum losses, and for losses TRL averages per micro-batch a weight on the
        advantage (the KL term is weighed apart, train/kl.py). Returns the advantages and, per row, the weight its
        tokens have in this process's loss (the step's normaliser: see `row_token_weight`)."""
        step_rows, step_tokens = self.step_normalisers(loss_mask, plan)
        count, per_step = len(plan.micro), self.args.gradient_accumulation_steps
        plan.num_items = [step_tokens[j] * count / per_step for j in range(count)]
        row_weight = self.row_token_weight(loss_mask, plan, step_rows, step_tokens, session_weight)
        self._log_normaliser(mode, step_rows, step_tokens)
        if self.loss_type not in ROW_AVERAGED_LOSSES + TOKEN_AVERAGED_LOSSES:
            return advantages, row_weight
        scale = per_step * self.accelerator.num_processes
        weights = torch.ones(loss_mask.size(0), device=loss_mask.device)
        for j, rows in enumerate(plan.micro):
            if rows and self.loss_type in ROW_AVERAGED_LOSSES:
                weights[rows] = len(rows) * scale / max(step_rows[j], 1.0)
            elif rows:
                weights[rows] = float(loss_mask[rows].sum()) * scale / max(step_tokens[j], 1.0)
        return advantages * (weights.unsqueeze(1) if advantages.dim() == 2 else weights), row_weight

    def row_token_weight(
        self,
        loss_mask: torch.Tensor,
        plan: MicroBatchPlan,
        step_rows: list[float],
        step_tokens: list[float],
        session_weight: torch.Tensor,
    ) -> torch.Tensor:
        """Per row: the factor on each of its tokens' loss in this process's loss, such that the gradient averaged
        over the processes is the step's — processes / the step's loss tokens for the token-level losses; processes ×
        session weight / (the row's loss tokens × the step's rows) for grpo and sapo; processes / (rows × L) for
        dr_grpo; processes / rows for luspo."""
        processes = float(self.accelerator.num_processes)
        weight = torch.zeros(loss_mask.size(0), device=loss_mask.device)
        row_tokens = loss_mask.sum(-1).float().clamp(min=1.0)
        for j, rows in enumerate(plan.micro):
            if not rows:
                continue
            if self.loss_type in PER_SEQUENCE_LOSSES:
                share = session_weight[rows] if self.args.session_weighting else 1.0
                weight[rows] = processes * share / (row_tokens[rows] * max(step_rows[j], 1.0))
            elif self.loss_type == "dr_grpo":
                weight[rows] = processes / (max(step_rows[j], 1.0) * self.dr_grpo_constant)
            elif self.loss_type == "luspo":
                weight[rows] = processes / max(step_rows[j], 1.0)
            else:
                weight[rows] = processes / max(step_tokens[j], 1.0)
        return weight

    def _log_normaliser(self, mode: str, step_rows: list[float], step_tokens: list[float]) -> None:
        """What the generation batch's steps divide their token sums by (per row for grpo/sapo/luspo: the rows)."""
        if not step_rows:
            return
        if self.loss_type == "dr_grpo":
            value = step_rows[0] * self.dr_grpo_constant
        elif self.loss_type in ROW_AVERAGED_LOSSES:
            value = step_rows[0]
        else:
            value = step_tokens[0]
        self._metrics[mode]["batch/loss_normaliser"].append(float(value))
