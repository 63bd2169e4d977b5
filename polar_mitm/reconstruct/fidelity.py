"""Context fidelity: is every sampled token trained in the context the engine sampled it in?

For each sampled span of a merged sequence (a run of `loss_mask == 1`, one per merged call), compare the tokens
before it — what the trainer conditions on — with the recorded `prompt_ids` of that call — what the engine
conditioned on. A span is *context-exact* when they are equal; its tokens then get, at the sampling weights,
exactly their recorded logprobs. Records whose prompt the engine rendered from a harness's rewritten history
(`polar_prompt_mode=messages`) drift here; token-exact prompts (`tokens`) do not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from polar_mitm.storage.merged import MergedSequence


@dataclass
class Fidelity:
    """Sampled tokens whose merged context equals their call's recorded prompt, over all sampled tokens."""

    exact_tokens: int = 0
    sampled_tokens: int = 0
    exact_spans: int = 0
    spans: int = 0

    def add(self, other: Fidelity) -> None:
        self.exact_tokens += other.exact_tokens
        self.sampled_tokens += other.sampled_tokens
        self.exact_spans += other.exact_spans
        self.spans += other.spans

    @property
    def share(self) -> float | None:
        return self.exact_tokens / self.sampled_tokens if self.sampled_tokens else None


def sampled_spans(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of every run of mask 1, in order."""
    mask = np.asarray(loss_mask, dtype=np.int8)
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True))


def sequence_fidelity(
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    request_ids: Sequence[str],
    prompts: Mapping[str, np.ndarray | None],
) -> Fidelity:
    """Fidelity of one merged sequence; `prompts` maps request id → recorded prompt ids (missing: not exact)."""
    result = Fidelity()
    ids = np.asarray(input_ids)
    spans = sampled_spans(loss_mask)
    if len(spans) != len(request_ids):  # not a merged layout we can attribute: count as unknown, not exact
        result.sampled_tokens = int(sum(end - start for start, end in spans))
        result.spans = len(spans)
        return result
    for (start, end), request_id in zip(spans, request_ids, strict=True):
        prompt = prompts.get(request_id)
        exact = prompt is not None and len(prompt) == start and np.array_equal(ids[:start], prompt)
        result.spans += 1
        result.sampled_tokens += end - start
        if exact:
            result.exact_spans += 1
            result.exact_tokens += end - start
    return result


def sequences_fidelity(
    sequences: Sequence[MergedSequence], prompts: Mapping[str, np.ndarray | None]
) -> Fidelity:
    total = Fidelity()
    for seq in sequences:
        total.add(sequence_fidelity(seq.input_ids, seq.loss_mask, seq.request_ids, prompts))
    return total
