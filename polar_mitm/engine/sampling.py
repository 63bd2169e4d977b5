"""Sampling parameters with SGLang's names, validated the way SGLang does (unknown keys are an error)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from polar_mitm.engines.greedy import is_greedy

# Every key SGLang's `sampling_params` accepts; anything else is a 400, as on SGLang.
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "n",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "custom_params",
        "logit_bias",
        "sampling_seed",
        "stream_interval",
    }
)
# Accepted by SGLang but not implemented by this CPU engine: only their neutral values are allowed, so a request
# never silently samples from a different distribution than the one whose logprobs we report.
NEUTRAL_ONLY = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "structural_tag": None,
    "logit_bias": None,
    "stop_regex": None,
    "custom_params": None,
}


class SamplingError(ValueError):
    """Invalid sampling parameters (→ HTTP 400)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    # Constrained decoding (engine/constraints.py), at most one of the three, as on SGLang.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_sglang(cls, raw: dict[str, Any] | None) -> SamplingParams:
        raw = dict(raw or {})
        unknown = sorted(set(raw) - SGLANG_SAMPLING_KEYS)
        if unknown:
            raise SamplingError(f"Unknown sampling_params keys: {unknown}")
        for key, neutral in NEUTRAL_ONLY.items():
            value = raw.pop(key, None)
            if value is not None and value != neutral:
                raise SamplingError(
                    f"sampling_params.{key}={value!r} is not supported by the embedded engine"
                )
        for key in ("spaces_between_special_tokens", "stream_interval"):
            raw.pop(key, None)
        known = {f.name for f in fields(cls)}
        params = cls(**{k: v for k, v in raw.items() if k in known and v is not None})
        params.validate()
        return params

    def validate(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise SamplingError("max_new_tokens must be a non-negative integer")
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise SamplingError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise SamplingError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise SamplingError("min_p must be in [0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise SamplingError("top_k must be -1 (off) or >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingError("stop must be a string or a list of non-empty strings")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise SamplingError("stop_token_ids must be integers")

    @property
    def greedy(self) -> bool:
        """Argmax decoding, with logprobs of the untempered distribution (as SGLang)."""
        return is_greedy(self.temperature, self.top_k)
