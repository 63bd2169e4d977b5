"""Which positions the trainer's LM head scores: only the tokens the loss reads.

TRL's fused head (`trl.trainer.utils.add_fused_lm_head`) projects a position through the vocabulary only if its
label is not -100. TRL labels every completion position, and a prefix-merged sequence's "completion" is everything
after the first prompt — tool outputs and later prompts included — while the loss reads only the sampled tokens
(the loss mask). On a packed row the whole row is the completion. So most of the head's work is thrown away: on the
tiny model (151k vocabulary) the head is nearly all of a training step, and on CPU TRL even scores every position of
the window (it scores only the labelled ones on Triton devices; elsewhere it keeps tile shapes fixed for compilers
such as Neuron's, which eager CPU does not need). Here the labels are -100 outside the positions asked for, and the
head scores only labelled positions on CPU too. Values at the scored positions are unchanged; elsewhere the
logprob (and entropy) is 0, which nothing reads: TRL's loss and metrics mask with `completion_mask * tool_mask`.

The scoring passes outside the loss (the behaviour check, stale rows' current logprobs, the KL reference) need no
gradient, so they run with gradient checkpointing off (`disable_gradient_checkpointing`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

IGNORE = -100  # the label of a position the head skips


@contextmanager
def disable_gradient_checkpointing(
    model, gradient_checkpointing_kwargs: dict | None = None
) -> Iterator[None]:
    """TRL's helper of the same name, reading transformers 5's `is_activation_checkpointing` (TRL 1.16 reads the
    deprecated `is_gradient_checkpointing`, which warns on every training step)."""
    was_enabled = model.is_activation_checkpointing
    if was_enabled:
        model.gradient_checkpointing_disable()
    try:
        yield
    finally:
        if was_enabled:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs)


def completion_labels(
    input_ids: torch.Tensor,
    logits_to_keep: int,
    scored: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Labels for the fused head: each of the last `logits_to_keep` tokens where `scored` ([B, logits_to_keep],
    None: all) is true, -100 elsewhere and wherever `skip` ([B, T]) is true (padding, a packed sequence's first
    token)."""
    labels = input_ids.clone()
    if skip is not None:
        labels = labels.masked_fill(skip, IGNORE)
    labels[:, :-logits_to_keep] = IGNORE
    if scored is not None:
        window = labels[:, -logits_to_keep:]
        labels[:, -logits_to_keep:] = window.masked_fill(~scored.to(torch.bool), IGNORE)
    return labels


def padded_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None,
    scored: torch.Tensor | None = None,
    *,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    autocast=None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """TRL's text-only `_get_per_token_logps_and_entropies` (padded rows, chunks of `batch_size`), scoring only the
    `scored` completion positions."""
    batch_size = batch_size or input_ids.size(0)
    logps, entropies, aux_losses = [], [], []
    for start in range(0, input_ids.size(0), batch_size):
        end = min(start + batch_size, input_ids.size(0))
        ids, mask = input_ids[start:end], attention_mask[start:end]
        labels = completion_labels(
            ids, logits_to_keep, None if scored is None else scored[start:end], mask == 0
        )
        inputs: dict[str, Any] = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "fused_lm_head": True,
        }
        if compute_aux_loss:
            inputs["output_router_logits"] = True
        with autocast if autocast is not None else nullcontext():
            outputs = model(**inputs)
        logps.append(outputs.log_probs[:, -logits_to_keep:])
        if compute_entropy:
            entropies.append(outputs.entropy[:, -logits_to_keep:])
        if compute_aux_loss:
            aux_losses.append(outputs.aux_loss)
    return (
        torch.cat(logps),
        torch.cat(entropies) if compute_entropy else None,
        torch.stack(aux_losses).mean() if compute_aux_loss else None,
    )


def score_labelled_positions_on_cpu() -> bool:
    """Make TRL's fused head project only the labelled positions on CPU as it does on Triton devices (see the module
    docstring). Idempotent; False (and nothing changed) if this TRL has no such switch — then every position of the
    window is scored, which is slower but gives the same values."""
    import trl.trainer.utils as trl_utils

    decide = getattr(trl_utils, "_use_triton", None)
    if decide is None:
        return False
    if getattr(decide, "polar_compact_on_cpu", False):
        return True

    def compact(device: torch.device) -> bool:
        return device.type == "cpu" or decide(device)

    compact.polar_compact_on_cpu = True  # type: ignore[attr-defined]
    compact.original = decide  # type: ignore[attr-defined]  # for benchmarks/bench_lm_head.py's baseline
    trl_utils._use_triton = compact
    return True
