"""Training rows → TRL's batches: `collate` pads a batch into prompt/completion tensors, and `LengthBucketSampler`
(TRL's RepeatSampler contract) groups rows of similar length so a batch wastes almost no padding.

Every row is in exactly one batch per epoch; the last batch is filled with zero-weight placeholder copies
(`padding_sources`), so no row is trained on more often than the others.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

from polar_mitm.train.turn_sampling import token_temperatures


def collate(
    rows: Sequence[dict[str, Any]], pad_token_id: int, default_temperature: float = 1.0
) -> dict[str, Any]:
    """Pad a batch of training rows into TRL's prompt/completion tensors.

    All rows are split at the same index, the shortest `prompt_len` of the batch: the "prompt" part is then the
    same width for every row (no left padding, positions exactly as sampled) and only the right end is padded, so a
    length-bucketed batch wastes almost nothing. Tokens of a longer prompt past the split land in the "completion"
    part with loss mask 0 — they are context, never trained on. `token_temperature` is each completion token's
    scoring temperature (its turn's; `default_temperature` where unknown), and placeholders get an all-zero loss mask.
    """
    import torch

    split = min(int(r["prompt_len"]) for r in rows)
    width = max(len(r["input_ids"]) for r in rows) - split
    n = len(rows)
    prompt_ids = torch.tensor([list(r["input_ids"][:split]) for r in rows], dtype=torch.long)
    completion_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.long)
    behaviour_logps = torch.zeros((n, width), dtype=torch.float32)
    temperature = torch.full((n, width), float(default_temperature), dtype=torch.float32)
    placeholder = torch.tensor([bool(r.get("placeholder")) for r in rows], dtype=torch.bool)
    for i, r in enumerate(rows):
        length = len(r["input_ids"])
        tail = length - split
        completion_ids[i, :tail] = torch.tensor(r["input_ids"][split:], dtype=torch.long)
        completion_mask[i, :tail] = 1
        if not placeholder[i]:
            loss_mask[i, :tail] = torch.tensor(r["loss_mask"][split:], dtype=torch.long)
        behaviour_logps[i, :tail] = torch.tensor(r["logprobs"][split:], dtype=torch.float32)
        starts, temps = r.get("turn_starts") or [r["prompt_len"]], r.get("turn_temperatures") or [None]
        temperature[i, :tail] = torch.tensor(
            token_temperatures(starts, temps, length, default_temperature)[split:]
        )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "loss_mask": loss_mask,
        "behaviour_logps": behaviour_logps * loss_mask,  # exactly 0.0 off the sampled tokens
        "advantages": torch.tensor([float(r["advantage"]) for r in rows], dtype=torch.float32),
        "rewards": torch.tensor([float(r["reward"]) for r in rows], dtype=torch.float32),
        "token_temperature": temperature,
        "session_weight": torch.tensor(
            [float(r.get("session_weight", 1.0)) for r in rows], dtype=torch.float32
        ),
        "placeholder": placeholder,
    }


def padding_fraction(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Share of the padded token grid that is padding, for `batches` of indices into `lengths`."""
    grid = sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
    return 1.0 - sum(lengths[i] for b in batches for i in b) / grid if grid else 0.0


def padding_sources(lengths: Sequence[int], batch_size: int) -> list[int]:
    """The rows copied as zero-weight placeholders to fill the last length bucket up to `batch_size`.

    Placeholder j has index `len(lengths) + j` in the training dataset (`TrainingData.to_dataset(batch_size)`). They
    are the rows just shorter than the last bucket's, so the padding adds little width and — whenever there are at
    least `batch_size` rows — no row appears twice in one batch.
    """
    n = len(lengths)
    short = (-n) % batch_size
    if not short:
        return []
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    full = n - n % batch_size  # rows in the full buckets, which precede the last one in length order
    if full >= short:
        return order[full - short : full]
    return [order[i % n] for i in range(short)]  # fewer rows than a batch: repeats are unavoidable


def length_buckets(
    lengths: Sequence[int], batch_size: int, *, seed: int = 0, shuffle: bool = True
) -> list[list[int]]:
    """Indices grouped into batches of similar length (sorted, chunked; the chunk order shuffled).

    Every row is in exactly one batch. The last batch is filled up to `batch_size` rows (TRL splits a generation batch
    evenly across accumulation steps) with placeholders — indices `len(lengths) + j`, zero-weight copies of
    `padding_sources(...)[j]` — so no row is used more often than the others.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if not order:
        return []
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    short = batch_size - len(chunks[-1])
    chunks[-1] = chunks[-1] + [len(order) + j for j in range(short)]
    if shuffle:
        random.Random(seed).shuffle(chunks)
    return chunks


class LengthBucketSampler:
    """TRL's RepeatSampler contract with length bucketing instead of prompt repetition.

    Yields global generation batches of `batch_size` indices of similar length, each repeated `repeat_count` times
    in a row (TRL reads a generation batch once and reuses it for `steps_per_generation × num_iterations` steps).
    Each row is in exactly one generation batch per epoch (the last is filled with zero-weight placeholders, see
    `length_buckets`), so it is trained on exactly `num_iterations` times per epoch. A new shuffle of the bucket order
    per epoch.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        chunks = length_buckets(
            self.lengths, self.batch_size, seed=self.seed + self.epoch, shuffle=self.shuffle
        )
        self.epoch += 1
        for chunk in chunks:
            for _ in range(self.repeat_count):
                yield from chunk

    def __len__(self) -> int:
        n_chunks = math.ceil(len(self.lengths) / self.batch_size)
        return n_chunks * self.batch_size * self.repeat_count
