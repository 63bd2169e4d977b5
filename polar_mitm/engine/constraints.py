"""Constrained decoding (JSON schema, regex, EBNF) as SGLang does it, with llguidance on CPU.

SGLang compiles `sampling_params.json_schema` / `regex` / `ebnf` (chat: `response_format`) with a grammar backend
(xgrammar by default; `--grammar-backend llguidance` is one of its options) and, at every step, sets the logits of
tokens the grammar forbids to -inf *before* temperature, softmax and top-p/top-k. Its reported logprobs are
therefore `log_softmax(masked_logits / T)` at the sampled token: the constrained distribution, renormalised over
the allowed tokens. This module does exactly that. llguidance is a Rust wheel with no torch/triton dependency
(xgrammar pulls triton), so it runs on this CPU engine unchanged.

What that means for training: a constrained token's behaviour logprob is ≥ the model's own (unconstrained)
logprob of it — the mask moved probability mass onto it. A trainer that recomputes logprobs with the plain
model gets ratios < 1 on such tokens even with identical weights, so constrained calls are not on-policy samples
of the model; the gateway records them (`output_constraint`) so training can leave them out, as it does calls
with truncated sampling.
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass
from typing import Any

import torch

from polar_mitm.engine.sampling import SamplingError

# Side requests are short structured answers; flexible whitespace would let a small model pad forever.
JSON_OPTIONS = {"whitespace_flexible": False}


class ConstraintError(SamplingError):
    """A schema/regex/grammar the backend cannot compile (→ HTTP 400, as on SGLang)."""


@dataclass(frozen=True)
class ConstraintSpec:
    """What to constrain to: kind ∈ json_schema | regex | ebnf, and its source text."""

    kind: str
    source: str


def spec_from_params(json_schema: str | None, regex: str | None, ebnf: str | None) -> ConstraintSpec | None:
    """SGLang allows at most one of the three."""
    given = [
        (k, v) for k, v in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf)) if v is not None
    ]
    if len(given) > 1:
        raise ConstraintError("only one of json_schema, regex and ebnf may be given")
    if not given:
        return None
    kind, source = given[0]
    if not isinstance(source, str):
        raise ConstraintError(f"{kind} must be a string")
    return ConstraintSpec(kind, source)


def spec_from_response_format(response_format: Any) -> ConstraintSpec | None:
    """An OpenAI/SGLang chat `response_format` → the constraint SGLang derives from it (None for text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ConstraintError("response_format must be an object")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":  # SGLang: any JSON object
        return ConstraintSpec("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ConstraintError("response_format.json_schema.schema must be an object")
        return ConstraintSpec("json_schema", json.dumps(schema))
    raise ConstraintError(f"response_format type {kind!r} is not supported (text|json_object|json_schema)")


class GrammarCompiler:
    """Compiles specs against one tokenizer (llguidance's tokenizer wrapper takes ~1 s: built once, lazily)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        self._hf_tokenizer, self.vocab_size, self._eos = hf_tokenizer, vocab_size, sorted(eos_ids)
        self._lltok = None
        self._lock = threading.Lock()

    def _tokenizer(self):
        import llguidance

        with self._lock:
            if self._lltok is None:
                # What llguidance.hf.from_tokenizer does, without its isinstance check (transformers 5 renamed
                # the fast tokenizer class): the Rust tokenizer's JSON, padding and truncation off.
                backend = copy.copy(self._hf_tokenizer.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                self._lltok = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._lltok

    def compile(self, spec: ConstraintSpec) -> Constraint:
        import llguidance

        try:
            if spec.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
            elif spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.source)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(llguidance.gbnf_to_lark(spec.source))
        except ValueError as exc:
            raise ConstraintError(f"invalid {spec.kind}: {exc}") from exc
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"invalid {spec.kind}: {matcher.get_error()}")
        return Constraint(spec, matcher, self.vocab_size)


class Constraint:
    """One generation's grammar state: the allowed-token mask before each step, advanced by each sampled token."""

    def __init__(self, spec: ConstraintSpec, matcher, vocab_size: int) -> None:
        self.spec, self._matcher, self.vocab_size = spec, matcher, vocab_size
        self._bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
        self._bits = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """Bool mask over the vocabulary: True where the grammar allows the token next."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        bits = (self._bitmask[0].unsqueeze(1) >> self._bits) & 1  # (words, 32), little-endian bit order
        return bits.flatten()[: self.vocab_size].bool()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with forbidden tokens at -inf (SGLang's vocab mask); logits beyond the vocabulary too."""
        mask = self.allowed()
        if logits.numel() > mask.numel():  # padded embedding rows are never tokens
            mask = torch.cat([mask, torch.zeros(logits.numel() - mask.numel(), dtype=torch.bool)])
        return logits.masked_fill(~mask[: logits.numel()], float("-inf"))

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ConstraintError(f"the grammar rejected token {token_id}: {self._matcher.get_error()}")

    def finished(self) -> bool:
        """The grammar allows nothing more (the matcher stopped, e.g. after EOS)."""
        return self._matcher.is_stopped()
