"""The scripted test policy on vLLM: a random model that answers with the script's tool calls and final answer (the
embedded engine's `--script` format, polar_mitm/engine/script.py), while every recorded logprob stays the model's
own log-probability of that token — so real harness sessions run through vLLM and train honestly.

Why not a plain forcing processor: vLLM (0.32, `v1/sample/sampler.py`) computes the logprobs it reports from the
logits *after* the logits processors (`processed_logprobs`, ours; the grammar bitmask of structured output is even
applied before the sampler, so it reaches `raw_logprobs` too). A processor that forces a token by masking the
others reports log p = 0 for it (measured: tests/vllm/test_vllm_scripted.py). So `ScriptedPolicy`, loaded with
vLLM's documented `--logits-processors`, leaves the logits untouched: it only tracks, per request of the batch,
which scripted token comes next. The forcing happens one step later, on the sampled ids: a wrapper around
`Sampler.sample` (installed when vLLM builds the processor, in its engine process) replaces the sampled id of each
scripted request by its scripted token. vLLM then gathers the reported logprob, rank and top-k alternatives at
that token from the untouched distribution, exactly as if the model had sampled it. One more step for a request
that asked for top-k/top-p: a forced token need not lie in the nucleus (vLLM would report -inf, as -9999.0), and
it was not drawn from it, so its row of processed logprobs is the model's at the request's temperature before the
cut — SGLang's semantics, what the embedded engine's scripted turns record (the trainer leaves such turns out of
the loss unless told otherwise). A grammar (structured output) still applies: vLLM masks the logits before its
sampler, and ends a request whose grammar rejects a token, so a script's answer to a constrained request must fit.

The script is this process's (`POLAR_VLLM_SCRIPT` at start, or set and cleared at run time through the worker
extension's `polar_set_script` over `/collective_rpc`); with none set, vLLM samples freely. A request's next turn
is chosen as the embedded engine chooses it: the assistant turns already in its prompt, the tool names offered
(read from the `<tools>` block the chat template renders into the prompt: vLLM's token-in calls carry no tool
list) and the script's `replies`. A `choices` turn is decided at the first token where its candidates differ, by
the model's probabilities of those tokens at the request's temperature (the embedded engine weighs whole answers:
with candidates that differ in one token both move with that token's logprob).

Runs inside vLLM's processes: imports vLLM, torch, transformers and the standard-library-only script module.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from polar_mitm.engine.script import Script
from polar_mitm.vllm import SCRIPT_ENV

log = logging.getLogger(__name__)

GREEDY_TEMPERATURE = 1e-5  # vLLM's own threshold for greedy rows (sampler._SAMPLING_EPS)
# The tool list Qwen-family chat templates render into the system prompt, one JSON object per line.
TOOLS_BLOCK = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)


@dataclass
class ActiveScript:
    """The script this process plays, with the tokenizer its ids come from."""

    script: Script
    tokenizer: Any
    path: str


_active: ActiveScript | None = None


def activate(path: str | None, tokenizer_path: str) -> str | None:
    """Play the script at `path` from the next request on (None: sample freely again); returns the path."""
    global _active
    if path is None:
        _active = None
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"the tokenizer at {tokenizer_path} has no end-of-turn (eos) token for scripted turns"
        )
    _active = ActiveScript(Script.load(path, tokenizer, eos), tokenizer, str(Path(path)))
    log.info("polar scripted policy: playing %s", path)
    return _active.path


# Seconds the engine rests after each step (0: none), set by `polar_set_pace`: on a loaded 2-core machine vLLM's
# engine can hold the cores for a whole call, so its own server streams the call in one burst at the end and a test
# cannot act in the middle of it (measured: the first chunk 15 s into a 15 s call); resting gives the cores back.
_pace_seconds = 0.0


def set_pace(seconds: float) -> float:
    """Rest `seconds` after every engine step from now on (0: run at full speed again); returns the pace."""
    global _pace_seconds
    if not 0 <= seconds <= 1:
        raise ValueError(f"a pace of {seconds} s per step: give 0 to 1")
    _pace_seconds = float(seconds)
    return _pace_seconds


def active_script_path() -> str | None:
    return None if _active is None else _active.path


def tool_names_in_prompt(prompt_text: str) -> list[str]:
    """The tools a rendered prompt offers ([] when its system prompt has no `<tools>` block: a side request)."""
    match = TOOLS_BLOCK.search(prompt_text)
    if match is None:
        return []
    names = []
    for line in match.group(1).splitlines():
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        if isinstance(tool, dict):
            function = tool.get("function", tool)
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                names.append(function["name"])
    return names


@dataclass
class ScriptedRequest:
    """One request of the batch that plays a scripted turn: its candidates' ids and its output so far (vLLM's own
    list, which it keeps current before each sampling step)."""

    candidates: list[list[int]]
    output_ids: list[int]

    def next_tokens(self) -> list[int]:
        """The distinct next tokens of the candidates that agree with the output so far ([]: nothing to force)."""
        done = len(self.output_ids)
        nexts: list[int] = []
        for ids in self.candidates:
            if len(ids) > done and ids[:done] == self.output_ids and ids[done] not in nexts:
                nexts.append(ids[done])
        return nexts


def scripted_request(prompt_ids: Sequence[int] | None, output_ids: list[int]) -> ScriptedRequest | None:
    """The scripted turn of a request just added to the batch (None: no script, or no prompt ids)."""
    active = _active
    if active is None or prompt_ids is None:
        return None
    prompt = list(prompt_ids)
    tool_names = tool_names_in_prompt(active.tokenizer.decode(prompt))
    return ScriptedRequest(active.script.candidate_ids_for(prompt, tool_names), output_ids)


class ScriptedPolicy(LogitsProcessor):
    """Tracks which scripted token each request of the batch takes next; the logits stay the model's."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.requests: dict[int, ScriptedRequest] = {}
        install_sampler_hook()
        path = os.environ.get(SCRIPT_ENV)
        if path and active_script_path() != str(Path(path)):
            activate(path, vllm_config.model_config.tokenizer)

    def is_argmax_invariant(self) -> bool:
        return True  # it never changes the logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.requests, batch_update, lambda params, prompt, output: scripted_request(prompt, output)
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if _pace_seconds:
            time.sleep(_pace_seconds)
        return logits

    def scripted_rows(self) -> dict[int, list[int]]:
        """Batch row → the scripted tokens it may take next, for the requests that play a scripted token now."""
        rows = {row: request.next_tokens() for row, request in self.requests.items()}
        return {row: nexts for row, nexts in rows.items() if nexts}

    def force(
        self,
        rows: dict[int, list[int]],
        sampled: torch.Tensor,
        logits: torch.Tensor,
        model_logprobs: torch.Tensor | None,
        processed_logprobs: torch.Tensor | None,
        metadata: Any,
    ) -> None:
        """Replace each scripted row's sampled id by its scripted token, and its processed logprobs by the model's
        at the request's temperature before any top-k/top-p cut: a forced token was not drawn from the truncated
        distribution (outside it vLLM would report -inf, sent as -9999.0), and SGLang's logprobs — what the
        embedded engine's scripted turns record — are these."""
        for row, nexts in rows.items():
            sampled[row] = nexts[0] if len(nexts) == 1 else choose_token(row, nexts, logits, metadata)
        if processed_logprobs is not None and model_logprobs is not None:
            processed_logprobs[list(rows)] = model_logprobs


def choose_token(row: int, tokens: list[int], logits: torch.Tensor, metadata: Any) -> int:
    """A `choices` turn's divergent token: one of `tokens` by the model's probabilities restricted to them.

    `logits` are the sampler's, already divided by the temperature for sampled rows (vLLM divides in place), so
    softmax over the candidates is the model's distribution at the request's temperature, renormalised."""
    scores = logits[row, tokens].float()
    temperature = metadata.temperature
    if (
        temperature is None
        or float(temperature[row]) < GREEDY_TEMPERATURE
        or not torch.isfinite(scores).any()
    ):
        return tokens[int(scores.argmax())]
    probabilities = torch.softmax(scores, dim=-1)
    pick = torch.multinomial(probabilities, 1, generator=metadata.generators.get(row))
    return tokens[int(pick)]


def tempered_logprobs(logits: torch.Tensor, rows: list[int], metadata: Any) -> torch.Tensor:
    """log_softmax(logits / T) of `rows`, each at its request's temperature (greedy rows at 1, as vLLM scores them)."""
    temperature = metadata.temperature
    if temperature is None:
        scale = torch.ones(len(rows), dtype=torch.float32, device=logits.device)
    else:
        chosen = temperature[rows].to(torch.float32)
        scale = torch.where(chosen < GREEDY_TEMPERATURE, torch.ones_like(chosen), chosen)
    return (logits[rows].to(torch.float32) / scale.unsqueeze(1)).log_softmax(dim=-1)


def install_sampler_hook() -> None:
    """Wrap vLLM's `Sampler.sample` once per process so that scripted requests take their scripted tokens."""
    from vllm.v1.sample.sampler import Sampler

    if getattr(Sampler.sample, "polar_scripted", False):
        return
    original = Sampler.sample

    def sample(self, logits: torch.Tensor, sampling_metadata: Any, *args: Any, **kwargs: Any):
        scripted = [p for p in sampling_metadata.logitsprocs.all if isinstance(p, ScriptedPolicy)]
        rows = scripted[0].scripted_rows() if scripted else {}
        # The model's logprobs of the scripted rows, taken before vLLM's sampling divides and cuts the logits in place
        # (the raw modes report values from before the processors anyway).
        tempered = bool(rows) and self.logprobs_mode == "processed_logprobs"
        model_logprobs = tempered_logprobs(logits, list(rows), sampling_metadata) if tempered else None
        sampled, processed_logprobs = original(self, logits, sampling_metadata, *args, **kwargs)
        if rows:
            scripted[0].force(rows, sampled, logits, model_logprobs, processed_logprobs, sampling_metadata)
        return sampled, processed_logprobs

    sample.polar_scripted = True  # type: ignore[attr-defined]
    Sampler.sample = sample  # type: ignore[method-assign]
