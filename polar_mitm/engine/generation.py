"""Token generation with true logprobs on CPU: the part of SGLang's scheduler the gateway relies on.

Logprobs are `log_softmax(logits / temperature)` at the sampled token, before top-p/top-k/min-p truncation, as in
SGLang, so a trainer that recomputes them at the same temperature gets the same numbers. The sampled ids include
the EOS/stop token that ended generation; only the text is trimmed.

A weight push lands between two tokens of a running generation (`update_weights_from_disk`): the new weights are
loaded off the generation lock and handed over; the generation swaps them in at its next token boundary, re-prefills
its context (prompt + tokens so far) under them, so every later token's logprob is exactly the new weights', and
starts a new version span (`Generation.version_spans`). Without a running generation the push swaps at once.

A push may instead abort the running generation (`abort_running`, SGLang's default behaviour, `polar-mitm serve
--on-push abort`): it ends at its next token boundary with finish `abort`, and the weights are swapped before any
other generation starts — the gateway then resumes the call from the tokens sampled so far (gateway/live.py).
"""

from __future__ import annotations

import inspect
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from polar_mitm.engine.constraints import ConstraintSpec, GrammarCompiler, spec_from_params
from polar_mitm.engine.prefix_cache import DEFAULT_BUDGET_BYTES, PrefixCache
from polar_mitm.engine.sampling import SamplingParams
from polar_mitm.engine.tool_call_formats import DEFAULT_TOOL_CALL_PARSER, tool_call_format
from polar_mitm.engines.greedy import GREEDY_SCORING_TEMPERATURE, scoring_temperature

PREFILL_CHUNK = 8192  # bounds attention memory on 30k+ token prompts


def continued(candidates: list[list[int]], answered: list[int]) -> list[list[int]]:
    """What is left of each scripted candidate the prompt has begun (`answered`: a resumed call's tokens so far);
    the candidates as they are when none has begun."""
    n = len(answered)
    left = [ids[n:] for ids in candidates if n and ids[:n] == answered and len(ids) > n]
    return left or candidates


class ContextOverflow(ValueError):
    """The prompt does not fit in the model's context (→ HTTP 400, as on SGLang)."""


@dataclass
class TokenStep:
    """One sampled token, as handed to streaming callbacks."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[float, int]]
    weight_version: str | None = None  # the weights that sampled it


@dataclass
class Generation:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    text: str = ""
    finish_reason: dict | None = None
    weight_version: str = "0"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    queue_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    constraint: str | None = (
        None  # json_schema | regex | ebnf when decoding was constrained (logprobs masked)
    )
    # (index into output_ids, weight version) where each span of tokens under one version starts; a push that
    # lands mid-generation adds one. `weight_version` is the first span's.
    version_spans: list[tuple[int, str]] = field(default_factory=list)

    def spans(self) -> list[dict[str, Any]]:
        """The version spans as JSON objects ({start, version}), one span of `weight_version` when none."""
        spans = self.version_spans or [(0, self.weight_version)]
        return [{"start": start, "version": version} for start, version in spans]

    def meta_info(self) -> dict:
        """SGLang's `meta_info` for this generation."""
        return {
            "id": self.request_id,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": self.weight_version,
            "version_spans": self.spans(),
            "e2e_latency": self.queue_s + self.prefill_s + self.decode_s,
            "prefill_latency": self.prefill_s,
            "decode_latency": self.decode_s,
            "queue_time": self.queue_s,
            "constraint": self.constraint,
            "output_token_logprobs": [
                [lp, tid, None] for lp, tid in zip(self.output_logprobs, self.output_ids, strict=True)
            ],
        }


class Engine:
    """A transformers causal LM behind a lock: one generation at a time, so requests never corrupt each other."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        served_model_name: str | None = None,
        context_length: int | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        script_path: str | Path | None = None,
        prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        from transformers import AutoTokenizer

        self.model_path = Path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = self._load_model(self.model_path)
        # transformers renamed `past_key_values` to `cache` in 5.x; use whichever this version takes.
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"
        meta_file = self.model_path / "polar_model.json"
        self.model_meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        self.served_model_name = served_model_name or self.model_meta.get("kind") or self.model_path.name
        self.context_length = context_length or int(self.model.config.max_position_embeddings)
        # Parsers are server flags, as on SGLang; the built-in models say which ones fit them.
        self.tool_call_parser = tool_call_parser or self.model_meta.get(
            "tool_call_parser", DEFAULT_TOOL_CALL_PARSER
        )
        tool_call_format(self.tool_call_parser)  # an unknown name is refused at start, not at the first call
        self.reasoning_parser = reasoning_parser or self.model_meta.get("reasoning_parser", "none")
        self.weight_version = "0"
        self.eos_ids = self._eos_ids()
        self._lock = threading.Lock()
        # A push's loaded weights and version, waiting for the next token boundary (or a free lock) to be swapped in.
        self._pending: tuple[Any, str] | None = None
        self._swapped = threading.Event()
        self._push_lock = threading.Lock()  # one push at a time
        # The waiting push aborts the running generation instead of landing in it.
        self._abort_for_push = False
        self.last_push_pause = 0.0  # seconds the last push stalled a running generation (its re-prefill)
        self.prefix_cache = PrefixCache(prefix_cache_bytes)  # used under the lock only
        self.grammars = GrammarCompiler(self.tokenizer, int(self.model.config.vocab_size), self.eos_ids)
        self.script = None
        if script_path is not None:
            from polar_mitm.engine.script import Script

            eos = (
                self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else min(self.eos_ids)
            )
            self.script = Script.load(script_path, self.tokenizer, eos)

    @staticmethod
    def _load_model(path: Path):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        return model

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = self.model.generation_config.eos_token_id
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- weights -------------------------------------------------------------------------------------------------

    def update_weights_from_disk(
        self, model_path: str | Path, weight_version: str | None = None, *, abort_running: bool = False
    ) -> str:
        """Load weights from a checkpoint directory (same architecture) and swap them in with a new weight version:
        at once when no generation runs, else at the running generation's next token boundary (returns then) —
        where `abort_running` ends that generation there (finish `abort`) instead of continuing it."""
        model = self._load_model(Path(model_path))
        with self._push_lock:
            version = (
                str(weight_version)
                if weight_version
                else str(int(self.weight_version) + 1 if self.weight_version.isdigit() else 1)
            )
            self._swapped.clear()
            self._abort_for_push = abort_running
            self.last_push_pause = 0.0
            self._pending = (model, version)
            while not self._swapped.is_set():
                if self._lock.acquire(blocking=False):  # no generation holds it: swap now
                    try:
                        self._swap_pending()
                    finally:
                        self._lock.release()
                    break
                self._swapped.wait(0.01)  # the generation swaps at its next token, or ends and frees the lock
        return version

    def _swap_pending(self, *, done: bool = True) -> bool:
        """Swap in a pushed model, if one waits (caller holds the lock); True when it did. `done=False`: the push
        is told later (after the running generation's re-prefill, whose time it reports)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        self.model, self.weight_version = pending
        self.prefix_cache.clear()  # those keys and values came from the old weights
        if done:
            self._swapped.set()
        return True

    # -- forward passes ------------------------------------------------------------------------------------------

    def _prefill(self, ids: list[int], cache) -> torch.Tensor:
        """Run `ids` through the model in chunks, filling `cache`; return the last position's logits."""
        logits = None
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = torch.tensor([ids[start : start + PREFILL_CHUNK]], dtype=torch.long)
            out = self.model(input_ids=chunk, **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1]
        assert logits is not None
        return logits.float()

    def _cache_for(self, prompt_ids: list[int]):
        """A cache already holding the longest reusable prefix of `prompt_ids`, and that prefix's length."""
        reused = self.prefix_cache.take(prompt_ids)
        return reused if reused is not None else (self._new_cache(), 0)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def check_constraint(self, params: SamplingParams) -> ConstraintSpec | None:
        """The request's constraint, compiled once to reject a bad schema/regex/grammar up front (HTTP 400)."""
        spec = spec_from_params(params.json_schema, params.regex, params.ebnf)
        if spec is not None:
            self.grammars.compile(spec)
        return spec

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ContextOverflow("The prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise ContextOverflow(
                f"The input ({len(prompt_ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )

    @torch.inference_mode()
    def score(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        """Logprobs of `completion_ids` after `prompt_ids` under the current weights (a plain forward pass)."""
        self.check_prompt(prompt_ids)
        if not completion_ids:
            return []
        with self._lock:
            cache = self._new_cache()
            if len(prompt_ids) > 1:
                self._prefill(prompt_ids[:-1], cache)
            tail = torch.tensor([[prompt_ids[-1], *completion_ids[:-1]]], dtype=torch.long)
            logits = self.model(input_ids=tail, **{self._cache_kw: cache}, use_cache=True).logits[0].float()
        logp = torch.log_softmax(logits / scoring_temperature(temperature), dim=-1)
        return logp.gather(1, torch.tensor(completion_ids).unsqueeze(1)).squeeze(1).tolist()

    # -- generation ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        top_logprobs_num: int = 0,
        on_token: Callable[[TokenStep], None] | None = None,
        cancelled: threading.Event | None = None,
        request_id: str | None = None,
        tool_names: Sequence[str] | None = None,
    ) -> Generation:
        """Sample a completion for `prompt_ids`; `cancelled` (e.g. a client disconnect) aborts between tokens.

        `tool_names` (the request's tools; None when unknown) only matters to a scripted policy, whose turns may
        depend on which tools the harness offers.
        """
        self.check_prompt(prompt_ids)
        gen = Generation(request_id=request_id or uuid.uuid4().hex, prompt_ids=list(prompt_ids))
        max_new = min(params.max_new_tokens, self.context_length - len(prompt_ids))
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        rng = torch.Generator()
        rng.manual_seed(
            params.sampling_seed
            if params.sampling_seed is not None
            else int.from_bytes(uuid.uuid4().bytes[:6], "little")
        )
        queued = time.perf_counter()
        with self._lock:
            self._swap_pending()
            gen.weight_version = self.weight_version
            gen.version_spans.append((0, self.weight_version))
            t0 = time.perf_counter()
            gen.queue_s = t0 - queued
            if max_new <= 0:
                gen.finish_reason = {"type": "length", "length": 0}
                return gen
            forced = None
            if self.script is not None:
                candidates = continued(
                    self.script.candidate_ids_for(prompt_ids, tool_names), self.script.answered(prompt_ids)
                )
                forced = (
                    candidates[0]
                    if len(candidates) == 1
                    else self._choose(prompt_ids, candidates, params, rng)
                )
            # A scripted turn is written by the test, not sampled: no grammar applies to it.
            spec = None if forced else spec_from_params(params.json_schema, params.regex, params.ebnf)
            constraint = self.grammars.compile(spec) if spec is not None else None
            gen.constraint = spec.kind if spec is not None else None
            cache, gen.cached_tokens = self._cache_for(prompt_ids)
            logits = self._prefill(prompt_ids[gen.cached_tokens :], cache)
            t1 = time.perf_counter()
            gen.prefill_s = t1 - t0
            while True:
                if cancelled is not None and cancelled.is_set():
                    gen.finish_reason = {"type": "abort", "message": "client disconnected"}
                    break
                if self._pending is not None and self._abort_for_push:
                    # SGLang's default: the push aborts the call (whoever holds the lock next swaps the weights).
                    gen.finish_reason = {"type": "abort", "message": "aborted by a weight update"}
                    break
                if self._pending is not None and self._swap_pending(done=False):
                    # A push landed between two tokens: the rest is sampled by the new weights, from their own
                    # keys and values of the whole context.
                    stalled = time.perf_counter()
                    cache = self._new_cache()
                    logits = self._prefill(prompt_ids + gen.output_ids, cache)
                    self.last_push_pause = time.perf_counter() - stalled
                    self._swapped.set()
                    if gen.output_ids:
                        gen.version_spans.append((len(gen.output_ids), self.weight_version))
                    else:  # before the first token: the whole generation is the new weights'
                        gen.version_spans[-1] = (0, self.weight_version)
                        gen.weight_version = self.weight_version
                forced_id = (
                    forced[len(gen.output_ids)] if forced and len(gen.output_ids) < len(forced) else None
                )
                if constraint is not None:  # SGLang's vocab mask: before temperature, so logprobs are masked
                    logits = constraint.apply(logits)
                step = self._sample(logits, params, rng, top_logprobs_num, forced_id)
                step.weight_version = self.weight_version
                if constraint is not None:
                    constraint.advance(step.token_id)
                gen.output_ids.append(step.token_id)
                gen.output_logprobs.append(step.logprob)
                gen.output_top_logprobs.append(step.top_logprobs)
                if on_token is not None:
                    on_token(step)
                finish = self._finish_reason(gen.output_ids, params, stop_ids, max_new)
                if finish is not None:
                    gen.finish_reason = finish
                    break
                out = self.model(
                    input_ids=torch.tensor([[step.token_id]]), use_cache=True, **{self._cache_kw: cache}
                )
                logits = out.logits[0, -1].float()
            gen.decode_s = time.perf_counter() - t1
            # The cache holds the prompt and every output token fed back (all but the last): the next turn extends it.
            self.prefix_cache.put((prompt_ids + gen.output_ids)[: cache.get_seq_length()], cache)
        gen.text = self.output_text(gen.output_ids, params, gen.finish_reason)
        return gen

    def _finish_reason(
        self, output_ids: list[int], params: SamplingParams, stop_ids: set[int], max_new: int
    ) -> dict[str, Any] | None:
        """Why generation ends after the last sampled token (a stop id, a stop string, the budget), or None."""
        n = len(output_ids)
        if output_ids[-1] in stop_ids and n > params.min_new_tokens:
            return {"type": "stop", "matched": output_ids[-1]}
        if params.stop and n > params.min_new_tokens:
            matched = self._matched_stop_string(output_ids, params)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if n >= max_new:
            return {"type": "length", "length": n}
        return None

    def _choose(
        self, prompt_ids: list[int], candidates: list[list[int]], params: SamplingParams, rng: torch.Generator
    ) -> list[int]:
        """Sample one scripted candidate by the model's probability of the whole answer (caller holds the lock).

        The logprobs are the ones decoding will record for the chosen candidate: log_softmax(logits / T) at each of
        its tokens. Greedy takes the most probable candidate.
        """
        from polar_mitm.engine.script import choice_probabilities

        temperature = GREEDY_SCORING_TEMPERATURE if params.greedy else params.temperature
        token_logprobs = []
        for ids in candidates:
            full = torch.tensor([prompt_ids + ids[:-1]], dtype=torch.long)
            logits = self.model(input_ids=full, logits_to_keep=len(ids)).logits[0].float()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            token_logprobs.append(logp.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1).tolist())
        probabilities = choice_probabilities(token_logprobs)
        if params.greedy:
            return candidates[max(range(len(candidates)), key=probabilities.__getitem__)]
        return candidates[int(torch.multinomial(torch.tensor(probabilities), 1, generator=rng))]

    def _sample(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        rng: torch.Generator,
        top_logprobs_num: int,
        forced_id: int | None = None,
    ) -> TokenStep:
        temperature = GREEDY_SCORING_TEMPERATURE if params.greedy else params.temperature
        logp = torch.log_softmax(logits / temperature, dim=-1)
        if forced_id is not None:  # scripted policy: the token is given, its logprob is still the model's
            token = forced_id
        elif params.greedy:
            token = int(torch.argmax(logp))
        else:
            probs = logp.exp()
            if params.top_k > 0:
                kth = torch.topk(probs, min(params.top_k, probs.numel())).values[-1]
                probs = torch.where(probs < kth, 0.0, probs)
            if params.top_p < 1.0:
                sorted_p, order = torch.sort(probs, descending=True)
                cumulative = torch.cumsum(sorted_p, dim=0)
                drop = (cumulative - sorted_p) > params.top_p
                sorted_p[drop] = 0.0
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            if params.min_p > 0:
                probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
            token = int(torch.multinomial(probs, 1, generator=rng))
        top: list[tuple[float, int]] = []
        if top_logprobs_num > 0:
            values, ids = torch.topk(logp, top_logprobs_num)
            top = list(zip(values.tolist(), ids.tolist(), strict=True))
        return TokenStep(token_id=token, logprob=float(logp[token]), top_logprobs=top)

    def _matched_stop_string(self, output_ids: list[int], params: SamplingParams) -> str | None:
        # Only the tail can contain a newly completed stop string: decode a window, not the whole output.
        window = max(len(s) for s in params.stop) + 8
        tail = self.tokenizer.decode(output_ids[-window:], skip_special_tokens=params.skip_special_tokens)
        for stop in params.stop:
            if stop in tail:
                return stop
        return None

    def output_text(self, output_ids: list[int], params: SamplingParams, finish_reason: dict | None) -> str:
        """Decoded text with a matched stop string trimmed (unless `no_stop_trim`), as SGLang returns it."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens)
        matched = (finish_reason or {}).get("matched")
        if isinstance(matched, str) and not params.no_stop_trim:
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text
