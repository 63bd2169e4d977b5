"""What counts as greedy sampling, declared once for the gateway's records, the embedded engine and the trainer.

SGLang (the production engine, and the contract `polar-mitm serve` copies) samples by argmax when the temperature is
below its `_SAMPLING_EPS` (1e-6) or `top_k` is 1, and then reports logprobs of the untempered distribution. Every
place that decides "was this call greedy?" or "at which temperature are its logprobs?" asks here, so the records, the
engine and the loss cannot disagree on a call sampled at, say, T = 5e-6. No imports: any layer may depend on it.
"""

from __future__ import annotations

GREEDY_TEMPERATURE = 1e-6  # SGLang's _SAMPLING_EPS: below it, sampling is argmax
# A greedy call's logprobs are of the untempered distribution (SGLang; the embedded engine does the same), so greedy
# tokens are scored, and a kept greedy turn is trained, at T = 1.
GREEDY_SCORING_TEMPERATURE = 1.0


def is_greedy(temperature: float | None, top_k: int | None = None) -> bool:
    """Whether a call with these sampling parameters took the argmax (None: not given)."""
    return (temperature is not None and temperature < GREEDY_TEMPERATURE) or top_k == 1


def scoring_temperature(temperature: float) -> float:
    """The temperature a call's recorded logprobs are at: its own, or T = 1 for a greedy temperature."""
    return GREEDY_SCORING_TEMPERATURE if is_greedy(temperature) else temperature
