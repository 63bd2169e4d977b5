"""The KL penalty to the reference model (beta > 0): its estimator chosen, stale rows importance-weighted, and divided
by the policy term's normaliser.

TRL adds beta · k3 to every token's loss inside its own loss. Three things are wrong with that here:

- **Direction.** Written with log π − log π_ref = d on tokens sampled from π, the estimators' values all estimate
  KL(π‖π_ref), but used as a loss (the tokens fixed, the gradient taken through log π) they pull differently:
  k1 = d has gradient E[∇log π] = 0 in expectation (only sampling noise); k2 = d²/2 has E[d ∇log π] = ∇KL(π‖π_ref),
  the reverse KL the GRPO objective writes; k3 = e^(−d) + d − 1 (TRL's) has E[(1 − π_ref/π) ∇log π] = ∇KL(π_ref‖π),
  the forward KL (on-policy; checked exactly over a small vocabulary in tests/train/test_kl.py).
- **Stale rows** were sampled by older weights: the expectation over π needs the same importance weight
  pi_current / pi_behaviour (truncated) as their policy term, which TRL's KL never got.
- **Normaliser.** The policy term divides by the optimizer step's normaliser (train/normalisers.py); TRL's KL kept
  the micro-batch's, so a token's KL weight depended on the micro-batch it landed in.

So TRL's own KL is switched off (its beta is 0 while its loss runs, `_without_trl_kl`) and `_kl_penalty` adds
beta · Σ_t c_t · w_t · k(t) over the loss tokens: c_t the weight of the token in the policy term (the row's share
of the step's normaliser), w_t the stale row's importance weight (1 on fresh rows; times TRL's ratio with
`use_bias_correction_kl`), k the `kl_estimator`. Only loss tokens enter it: elsewhere d is set to 0 before any
exp(), so a context token the policy finds very unlikely cannot overflow into NaN.

Metrics, once per optimizer step over all its loss tokens (importance-weighted, over all processes): `kl`, the
penalised estimator's mean per token, and `kl/k1`, `kl/k2`, `kl/k3`, each estimator's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, get_args

import torch

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def kl_estimates(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per token, the three single-sample estimators of KL(π‖π_ref) from d = log π − log π_ref."""
    return {
        "k1": log_ratio,
        "k2": 0.5 * log_ratio**2,
        "k3": torch.exp(-log_ratio) + log_ratio - 1.0,
    }


class KLPenaltyMixin:
    """`PolarGRPOTrainer`'s KL term (listed before TRL's `GRPOTrainer`, whose `_compute_loss` runs without its own
    KL)."""

    _kl_window: torch.Tensor | None = None  # this optimizer step's sums so far, for the metrics

    @contextmanager
    def _without_trl_kl(self) -> Iterator[None]:
        """TRL's loss with beta 0: no KL of its own (it adds k3 at the micro-batch's normaliser); ours is added."""
        beta = self.beta
        self.beta = 0.0
        try:
            yield
        finally:
            self.beta = beta

    def _kl_penalty(self, inputs: dict, per_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """beta × the weighted sum of the estimator over this micro-batch's loss tokens (see the module docstring)."""
        log_ratio = torch.where(mask, per_token_logps - inputs["ref_per_token_logps"], 0.0)
        estimates = kl_estimates(log_ratio)
        importance = inputs.get("kl_importance_weight")
        importance = torch.ones_like(log_ratio) if importance is None else importance
        if self.args.use_bias_correction_kl:  # TRL's: times the PPO ratio (with its gradient, as TRL has it)
            anchor = inputs["old_per_token_logps"]
            importance = importance * torch.exp(torch.where(mask, per_token_logps - anchor, 0.0))
        weight = inputs.get("kl_weight")
        if weight is None:  # evaluation: the micro-batch's mean per token
            weight = importance / mask.sum().clamp(min=1)
        masked = mask.to(log_ratio.dtype)
        self._log_kl(estimates, importance.detach() * masked)
        return self.beta * (estimates[self.args.kl_estimator] * weight * masked).sum()

    def _log_kl(self, estimates: dict[str, torch.Tensor], weight: torch.Tensor) -> None:
        """Accumulate the step's weighted sums; at its last micro-batch, log each estimator's mean per token."""
        sums = torch.stack([(estimates[k].detach() * weight).sum() for k in KL_ESTIMATORS] + [weight.sum()])
        self._kl_window = sums if self._kl_window is None else self._kl_window + sums
        mode = "train" if self.model.training else "eval"
        if mode == "train" and not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._kl_window, reduction="sum")
        self._kl_window = None
        count = max(float(totals[-1]), 1e-12)
        means = {k: float(totals[i]) / count for i, k in enumerate(KL_ESTIMATORS)}
        metrics = self._metrics[mode]
        metrics["kl"].append(means[self.args.kl_estimator])
        for name, value in means.items():
            metrics[f"kl/{name}"].append(value)
