"""Each merged call ("turn") as it was sampled: the temperature its logprobs are at, and whether the loss can use it.

MERGED_SCHEMA v2 keeps the sampling parameters of every turn. The trainer scores a turn's tokens at its own
temperature, and by default leaves greedy, top-p/top-k/min-p-truncated and grammar-constrained turns out of the loss:
their recorded logprobs are not the probabilities of the distribution the trainer compares them with. What counts as
greedy is declared once, in polar_mitm/engines/greedy.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polar_mitm.engines.greedy import GREEDY_SCORING_TEMPERATURE, is_greedy
from polar_mitm.storage.merged import MergedSequence

EXCLUDED_GREEDY = "greedy"
EXCLUDED_TRUNCATED = "truncated"
EXCLUDED_CONSTRAINED = "constrained"


@dataclass(frozen=True)
class TurnSampling:
    """How one merged call was sampled, as the trainer needs it."""

    start: int  # index in input_ids of its first sampled token
    temperature: float | None  # the temperature its recorded logprobs are at (None: unknown, v1 data)
    excluded: str | None  # EXCLUDED_GREEDY | _TRUNCATED | _CONSTRAINED when its logprobs are not the policy's


def turn_sampling(seq: MergedSequence) -> list[TurnSampling]:
    """The turns of `seq` with their scoring temperature and why they would be excluded (v1 data: one unknown turn).

    Greedy: the token was the argmax, its probability under the sampler is 1 whatever the recorded logprob says.
    Truncated (top_p < 1, top_k > 0, min_p > 0): the sampler renormalised over a subset of the vocabulary, while the
    recorded logprob (like SGLang's) is of the full tempered distribution — the ratio's denominator is not the
    probability the token was drawn with.
    Constrained (JSON schema, regex, grammar): the recorded logprob is of the grammar-masked, renormalised
    distribution, while the trainer scores the unconstrained policy — the two disagree on every masked step.
    """
    starts = list(seq.turn_starts) if seq.turn_starts is not None else [seq.prompt_len]

    def column(values: Sequence | None) -> list:
        return list(values) if values is not None and len(values) == len(starts) else [None] * len(starts)

    temperatures, greedy = column(seq.turn_temperature), column(seq.turn_greedy)
    top_p, top_k, min_p = column(seq.turn_top_p), column(seq.turn_top_k), column(seq.turn_min_p)
    constrained = column(seq.turn_constrained)
    turns = []
    for k, start in enumerate(starts):
        t = temperatures[k]
        greedy_turn = bool(greedy[k]) or is_greedy(t, top_k[k])
        truncated = (
            (top_p[k] is not None and top_p[k] < 1.0)
            or (top_k[k] is not None and top_k[k] > 0)
            or (min_p[k] is not None and min_p[k] > 0.0)
        )
        excluded = (
            EXCLUDED_GREEDY
            if greedy_turn
            else EXCLUDED_TRUNCATED
            if truncated
            else EXCLUDED_CONSTRAINED
            if constrained[k]
            else None
        )
        scoring = GREEDY_SCORING_TEMPERATURE if greedy_turn else (None if t is None else float(t))
        turns.append(TurnSampling(start=int(start), temperature=scoring, excluded=excluded))
    return turns


def exclude_turns(loss_mask: Sequence[int], turns: Sequence[TurnSampling]) -> list[int]:
    """`loss_mask` with the sampled tokens of excluded turns set to 0 (they stay in the sequence as context)."""
    mask = list(loss_mask)
    for k, turn in enumerate(turns):
        if turn.excluded is None:
            continue
        end = turns[k + 1].start if k + 1 < len(turns) else len(mask)
        mask[turn.start : end] = [0] * (end - turn.start)
    return mask


def temperature_key(temperature: float | None) -> str:
    """How a temperature is counted in the data summary ("0.7"; "unknown" for v1 data)."""
    return "unknown" if temperature is None else f"{temperature:.6g}"


def token_temperatures(
    turn_starts: Sequence[int], turn_temperatures: Sequence[float | None], length: int, default: float
) -> list[float]:
    """The scoring temperature of every token of a row: its turn's (`default` where unknown). Tokens before the first
    turn (the prompt) take the first turn's: they are never scored for the loss."""
    temps = [default if t is None else float(t) for t in turn_temperatures] or [default]
    out = [temps[0]] * length
    for k, start in enumerate(turn_starts):
        end = turn_starts[k + 1] if k + 1 < len(turn_starts) else length
        out[start:end] = [temps[k]] * max(0, min(end, length) - start)
    return out
