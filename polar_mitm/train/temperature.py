"""Each completion token scored at the temperature of the call that sampled it.

A merged sequence's turns may come from calls sampled at different temperatures, and the ratio pi_theta /
pi_behaviour is only right when the trainer scores every token the way the engine sampled it. TRL divides all logits
by one `temperature`. `TokenTemperatureMixin` keeps TRL's fused head at that temperature and hooks the backbones it
reads (policy and reference) to scale the hidden state that predicts each completion token by T_global / T_token:
(h · s) W / T_global = h W / T_token, exact for an LM head without bias or logit soft-capping (rows at mixed
temperatures on a model with either are refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate.utils import is_peft_model


class TokenTemperatureMixin:
    """`PolarGRPOTrainer`'s per-token temperatures: `scoring_temperatures` sets them for the forward passes inside,
    `_per_temperature_logps` scores a batch with them (the trainer's `_get_per_token_logps_and_entropies` calls it
    when a token is not at `temperature`)."""

    _token_temperature: torch.Tensor | None = None  # per-token scoring temperatures of the current forward
    _hidden_factor: torch.Tensor | None = None  # what the backbone hook multiplies the hidden states by

    @contextmanager
    def scoring_temperatures(self, token_temperature: torch.Tensor | None) -> Iterator[None]:
        """Score the completion tokens of the forward passes inside at these temperatures ([B, completion])."""
        previous, self._token_temperature = self._token_temperature, token_temperature
        try:
            yield
        finally:
            self._token_temperature = previous

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
