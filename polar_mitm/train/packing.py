"""Micro-batches without padding waste: each one trimmed to its own longest row, or packed into one row.

TRL splits a generation batch by rows and keeps its width, so a 15-token row once ran at the width of a 330-token
one (69% padding). Here a scored generation batch (one padded tensor per key, as `PolarGRPOTrainer.
_generate_and_score_completions` returns it) is cut into the micro-batches `batching.micro_batches` planned, two
ways:

- `trimmed_micro_batch`: the rows, split at their own shortest prompt and cut to their own longest row;
- `packed_micro_batch`: the rows end to end in one row (batch size 1) with position ids restarting at 0 for each
  sequence, so there is no padding at all. The first token is the "prompt"; every other token is a "completion"
  position, the later sequences' prompts included (loss mask 0 there). Per-token tensors are concatenated the same
  way; the advantage becomes per token.

A packed row must never let one sequence attend to another. transformers does that itself for FlashAttention
(`flash_attention_2/3/4`: varlen kernels from the position ids) and, for sdpa, by building a dense block-causal mask
— O(tokens²) memory and no `is_causal` kernel. `segment_attention` instead runs sdpa with `is_causal` on each
sequence of the row in turn (the position ids say where each starts): no mask, the flash/efficient kernels, and the
same arithmetic as a row alone. `use_segment_attention` switches a model to it once packing is chosen.

The per-token logprobs of the three layouts agree (≤ 1e-5 in fp32 on CPU; tests/train/test_batching_trainer.py).
Packing changes what a "row" is, so only losses that weigh tokens alone can use it (`packing_refusal`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from polar_mitm.train.scoring import completion_labels

SEGMENT_ATTENTION = "polar_segments"
NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
# Losses whose normaliser and ratios are per token: a packed row of many sequences is the same sum of tokens.
PACKABLE_LOSSES = ("dapo", "bnpo", "cispo")
PROMPT_KEYS = ("prompt_ids", "prompt_mask")
_active_segments: list[tuple[int, int]] | None = (
    None  # the packed row in flight, for models that pass no positions
)


def segment_attention(module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
    """sdpa with `is_causal` on each sequence of a packed row (batch size 1), the sequences read from the position
    ids the decoder layer passes (also when activation checkpointing recomputes it in the backward); any other
    input is one causal sequence per row. The attention mask is not read: packed rows have none, and for the
    right-padded rows the trainer builds causal attention already keeps every real token off the padding."""
    kwargs.pop("is_causal", None)
    position_ids = kwargs.get("position_ids")
    segments = None
    if query.size(0) == 1 and position_ids is not None and position_ids.size(-1) == query.size(2):
        starts = sequence_starts(position_ids)
        segments = list(zip(starts, [*starts[1:], query.size(2)], strict=True))
    elif query.size(0) == 1 and _active_segments and _active_segments[-1][1] == query.size(2):
        segments = _active_segments
    if not segments or len(segments) == 1:
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, is_causal=True, **kwargs
        )[0]
        for a, b in segments
    ]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)


def sequence_starts(position_ids: torch.Tensor) -> list[int]:
    """Where each sequence of a packed row (position ids [1, T]) starts."""
    return (position_ids.reshape(-1) == 0).nonzero().flatten().tolist() or [0]


def _configs(model) -> list[Any]:
    """Every distinct config of a model's modules that names an attention implementation."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def attention_refusal(model) -> str | None:
    """Why `model` cannot run packed rows exactly and without a dense mask (None: it can)."""
    for config in _configs(model):
        implementation = config._attn_implementation
        if implementation in NATIVE_VARLEN or implementation == SEGMENT_ATTENTION:
            continue
        if implementation != "sdpa":
            return (
                f"attention implementation {implementation!r} (packing needs sdpa or flash_attention_2/3/4)"
            )
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            return "sliding-window attention"
        if getattr(config, "attn_logit_softcapping", None) is not None:
            return "attention logit soft-capping"
    return None


def packing_refusal(loss_type: str, importance_sampling_level: str, off_policy_mask_threshold) -> str | None:
    """Why the loss cannot be computed on packed rows (None: it can): a packed row is many sequences, so any
    per-sequence mean, sequence-level ratio or per-row normaliser would mix them."""
    if loss_type not in PACKABLE_LOSSES:
        return f"loss_type {loss_type!r} averages per sequence or per row (packable: {', '.join(PACKABLE_LOSSES)})"
    if importance_sampling_level != "token":
        return "sequence-level importance sampling"
    if off_policy_mask_threshold is not None:
        return "the sequence-level off-policy mask"
    return None


def use_segment_attention(model) -> None:
    """Run `model`'s sdpa layers as `segment_attention` from now on (FlashAttention ones read the position ids
    themselves). For good, not per forward: activation checkpointing recomputes a layer in the backward, after any
    per-forward switch would have ended. Exact for every input the trainer builds (packed, or right-padded)."""
    for config in _configs(model):
        if config._attn_implementation == "sdpa":
            config._attn_implementation = SEGMENT_ATTENTION


@contextmanager
def packed_segments(starts: Sequence[int], total: int) -> Iterator[None]:
    """The sequences of the packed row in flight, for models whose layers pass attention no position ids."""
    global _active_segments
    previous, _active_segments = _active_segments, list(zip(starts, [*starts[1:], total], strict=True))
    try:
        yield
    finally:
        _active_segments = previous


def packed_logps(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int,
    scored: torch.Tensor | None = None,
    *,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    autocast=None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """TRL's fused-head logprobs (and entropies, aux loss) of a packed row's last `logits_to_keep` tokens — only the
    `scored` ones (None: all; scoring.py). Each sequence's first token is no label: the position before it belongs
    to the previous sequence."""
    labels = completion_labels(input_ids, logits_to_keep, scored, position_ids == 0)
    inputs = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels, "fused_lm_head": True}
    if compute_aux_loss:
        inputs["output_router_logits"] = True
    use_segment_attention(model)
    segments = packed_segments(sequence_starts(position_ids), input_ids.size(1))
    with segments, autocast if autocast is not None else nullcontext():
        outputs = model(**inputs)
    logps = outputs.log_probs[:, -logits_to_keep:]
    entropies = outputs.entropy[:, -logits_to_keep:] if compute_entropy else None
    return logps, entropies, outputs.aux_loss if compute_aux_loss else None


# -- micro-batches from a scored generation batch ------------------------------------------------------------------


def row_lengths(batch: dict[str, Any]) -> torch.Tensor:
    """Tokens per row of a scored batch (prompt part + real completion tokens)."""
    return batch["prompt_ids"].size(1) + batch["completion_mask"].sum(-1)


def _layouts(batch: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """The batch's keys by layout: per completion token ([B, W]), per row ([B] or [B, 1]), and scalars."""
    rows, width = batch["completion_ids"].shape
    per_token, per_row, scalars = [], [], []
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or key in PROMPT_KEYS:
            continue
        if value.dim() == 0:
            scalars.append(key)
        elif value.dim() == 2 and value.shape == (rows, width):
            per_token.append(key)
        elif value.size(0) == rows:
            per_row.append(key)
    return per_token, per_row, scalars


def trimmed_micro_batch(
    batch: dict[str, Any], rows: Sequence[int], prompt_lens: Sequence[int]
) -> dict[str, Any]:
    """`rows` of a scored batch, split at their own shortest prompt (≥ the batch's split) and cut to their own
    longest row."""
    split = batch["prompt_ids"].size(1)
    index = torch.tensor(list(rows), dtype=torch.long, device=batch["prompt_ids"].device)
    own_split = max(split, min(int(prompt_lens[i]) for i in rows))
    end = int(row_lengths(batch)[index].max())
    full_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)[index]
    per_token, per_row, scalars = _layouts(batch)
    micro = {
        "prompt_ids": full_ids[:, :own_split],
        "prompt_mask": torch.ones_like(full_ids[:, :own_split]),
    }
    for key in per_token:
        micro[key] = batch[key][index][:, own_split - split : end - split]
    micro["completion_ids"] = full_ids[:, own_split:end]
    for key in per_row:
        micro[key] = batch[key][index]
    for key in scalars:
        micro[key] = batch[key]
    return micro


def packed_micro_batch(
    batch: dict[str, Any], rows: Sequence[int], fill: dict[str, float] | None = None
) -> dict[str, Any]:
    """`rows` of a scored batch end to end in one row; `position_ids` restart per sequence. Per-token tensors are
    concatenated (their value where a row's prompt part has none: `fill[key]`, default 0), the advantage becomes per
    token, and per-row tensors keep one entry per sequence."""
    fill = fill or {}
    split = batch["prompt_ids"].size(1)
    lengths = row_lengths(batch).tolist()
    full_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    per_token, per_row, scalars = _layouts(batch)

    def joined(values: torch.Tensor, prompt_value: float) -> torch.Tensor:
        parts = []
        for i in rows:
            parts.append(values.new_full((split,), prompt_value))
            parts.append(values[i, : lengths[i] - split])
        return torch.cat(parts)[1:].unsqueeze(0)  # the first token is the prompt

    ids = torch.cat([full_ids[i, : lengths[i]] for i in rows]).unsqueeze(0)
    micro = {"prompt_ids": ids[:, :1], "prompt_mask": torch.ones_like(ids[:, :1])}
    for key in per_token:
        micro[key] = joined(batch[key], fill.get(key, 0.0))
    micro["completion_ids"] = ids[:, 1:]
    micro["completion_mask"] = torch.ones_like(ids[:, 1:])  # every token is real
    positions = [torch.arange(lengths[i], device=ids.device) for i in rows]
    micro["position_ids"] = torch.cat(positions).unsqueeze(0)
    if "advantages" in per_row:
        per_row.remove("advantages")
        advantage = batch["advantages"].reshape(len(batch["advantages"]), -1)[:, :1]
        micro["advantages"] = joined(advantage.expand_as(batch["completion_mask"]).float(), 0.0)
    index = torch.tensor(list(rows), dtype=torch.long, device=ids.device)
    for key in per_row:
        micro[key] = batch[key][index]
    for key in scalars:
        micro[key] = batch[key]
    return micro


def scatter_micro_batch(
    values: torch.Tensor, batch: dict[str, Any], micro: dict[str, Any], rows: Sequence[int], out: torch.Tensor
) -> None:
    """Write a micro-batch's per-completion-token `values` back into `out`, the scored batch's [B, W] layout."""
    split, width = batch["prompt_ids"].size(1), micro["completion_ids"].size(1)
    if "position_ids" not in micro:  # trimmed: the rows' columns from their own split on
        offset = micro["prompt_ids"].size(1) - split
        out[torch.tensor(list(rows), device=out.device), offset : offset + width] = values.to(out.dtype)
        return
    lengths = row_lengths(batch).tolist()
    flat = torch.cat([values.new_zeros(1), values.reshape(-1)])  # the packed row's first token: the prompt
    start = 0
    for i in rows:
        out[i, : lengths[i] - split] = flat[start + split : start + lengths[i]].to(out.dtype)
        start += lengths[i]


def as_filler(micro: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch that computes but weighs nothing: no loss token, advantage 0, its rows placeholders."""
    filler = dict(micro)
    filler["tool_mask"] = torch.zeros_like(micro["tool_mask"])
    filler["advantages"] = torch.zeros_like(micro["advantages"])
    if "placeholder" in micro:
        filler["placeholder"] = torch.ones_like(micro["placeholder"])
    if "behaviour_logp_diff" in micro:
        filler["behaviour_logp_diff"] = torch.full_like(micro["behaviour_logp_diff"], float("nan"))
    return filler
