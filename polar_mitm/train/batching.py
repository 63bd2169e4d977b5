"""Training rows → TRL's batches: which rows share an optimizer step, and how each step is cut into micro-batches.

GRPO's advantages are group-relative, so a step must hold whole groups: an update built from part of a group has no
baseline (one synthetic run gave one step a mean advantage of +1.06 and the next ones only negative values).
`plan_batches` packs whole task groups — every sequence of every session — into *chunks* of at most
`BatchShape.chunk_rows` rows, in length order (groups of similar length share a chunk), and splits each chunk across
the processes by tokens. A chunk is the part of TRL's generation batch that `gcd(steps_per_generation,
gradient_accumulation_steps)` micro-batches per process cover, so every optimizer step is made of whole chunks and
holds whole groups, also across processes. `GroupBatchSampler` yields the plan in TRL's RepeatSampler contract;
empty slots hold a placeholder row that never reaches a forward pass.

**Dynamic sampling.** A group whose advantages are all 0 (equal rewards, one session, no task id) has no policy
gradient, yet under token-level losses its tokens would dilute the loss normaliser (two such groups holding 2/3 of
the tokens cut the gradient to 1/3). `plan_batches` leaves them out unless asked to keep them (and keeps them all
when nothing else is left, so a run on such data still runs).

**A group larger than a chunk** cannot grow the batch (TRL's generation batch has a fixed number of rows), so it is
split into parts, each part taking whole sessions dealt in advantage order so every part holds high and low
rewards. Each part is then treated as a smaller group: its advantages are recentred on the part's own mean (the
group's scale kept), so each step's mean advantage stays 0 — one baseline per step instead of a baseline shared by
steps that move the policy in turn. A part whose sessions all share one advantage — a single session (sessions so
long that two do not fit in a chunk, or one longer than a chunk, whose sequences are then cut into chunks), or only
failures because the group has too few passes to go round — keeps the group's advantages instead, since
recentring would erase its signal: the one case where a step's mean is not 0, counted and warned about.

`micro_batches` then cuts a process's share of a chunk into its micro-batches: rows sorted by length, split where
the largest micro-batch (its padded grid, or its tokens when packed) is smallest — never larger than the equal-count
split TRL would use, so memory stays bounded by `per_device_train_batch_size` rows of the longest length.

`collate` pads rows into TRL's prompt/completion tensors. `LengthBucketSampler` and `length_buckets` are the
earlier sampler (length buckets over all rows, groups ignored), kept for comparison (benchmarks/bench_train_step.py).
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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


# -- whole groups per optimizer step ------------------------------------------------------------------------------

MicroBatchCost = Literal["grid", "tokens"]
ADVANTAGE_TOL = 1e-12  # a part whose advantages differ by less than this has none (exactly 0)


@dataclass(frozen=True)
class BatchShape:
    """How TRL walks a generation batch: `per_device` rows per micro-batch slot, `processes`, and the micro-batches
    per generation (`steps_per_generation`) and per optimizer step (`accumulation_steps`)."""

    per_device: int
    processes: int
    steps_per_generation: int
    accumulation_steps: int

    @property
    def micro_per_chunk(self) -> int:
        """Micro-batches per process in a chunk: a whole number of them fills a generation batch and a step."""
        return math.gcd(self.steps_per_generation, self.accumulation_steps)

    @property
    def chunk_slots(self) -> int:
        """Rows of a chunk on one process."""
        return self.per_device * self.micro_per_chunk

    @property
    def chunk_rows(self) -> int:
        """Rows of a chunk over all processes: the most rows a group may have and stay whole."""
        return self.chunk_slots * self.processes

    @property
    def chunks_per_generation(self) -> int:
        return self.steps_per_generation // self.micro_per_chunk

    @property
    def generation_rows(self) -> int:
        return self.per_device * self.processes * self.steps_per_generation


@dataclass
class BatchUnit:
    """Rows that must share a chunk: a whole group, or one part of a group too large for a chunk."""

    group: str
    rows: list[int]
    advantage: dict[int, float] = field(default_factory=dict)  # recentred advantages of a split group's part
    uncentred: bool = False  # a part that keeps the group's advantages (see _recentred_part)


@dataclass
class BatchPlan:
    """Chunks (each: per process, the row indices it trains) and what the plan left out or changed."""

    chunks: list[list[list[int]]]
    advantage: dict[int, float]  # row → advantage, where a split part recentred it
    zero_advantage_groups: int = 0  # left out (dynamic sampling)
    zero_advantage_rows: int = 0
    zero_advantage_tokens: int = 0
    zero_advantage_kept: bool = False
    split_groups: int = 0  # groups larger than a chunk, trained in parts
    uncentred_parts: int = 0  # parts of one session or one reward: they keep the group's advantages
    rows_per_chunk: float = 0.0  # real rows over chunk_rows: how full the steps are

    def rows(self) -> list[int]:
        return [i for chunk in self.chunks for share in chunk for i in share]


def group_key(row: dict[str, Any]) -> str:
    """The GRPO group of a row: its task, or its own session where it has none (a group of one)."""
    task = row.get("task_id")
    return f"task:{task}" if task is not None else f"session:{row['session_id']}"


def plan_batches(
    rows: Sequence[dict[str, Any]], shape: BatchShape, *, keep_zero_advantage: bool = False
) -> BatchPlan:
    """Whole groups packed into chunks of at most `shape.chunk_rows` rows, in length order, each chunk's rows
    split across the processes (see the module docstring). Deterministic: every process builds the same plan."""
    lengths = [len(r["input_ids"]) for r in rows]
    units = [
        unit
        for group, members in _groups(rows).items()
        for unit in _split_group(group, members, rows, shape.chunk_rows)
    ]
    informative = [u for u in units if _has_advantage(u, rows)]
    dropped = [u for u in units if not _has_advantage(u, rows)]
    kept_all = keep_zero_advantage or not informative  # nothing to learn: train on them as they are
    chosen = units if kept_all else informative
    chunks = _pack_units(chosen, lengths, shape.chunk_rows)
    chunks += [[] for _ in range((-len(chunks)) % shape.chunks_per_generation)]
    dropped_rows = [] if kept_all else [i for u in dropped for i in u.rows]
    real = sum(len(c) for c in chunks)
    return BatchPlan(
        chunks=[_split_across_processes(c, lengths, shape) for c in chunks],
        advantage={i: a for u in chosen for i, a in u.advantage.items()},
        zero_advantage_groups=0 if kept_all else len({u.group for u in dropped}),
        zero_advantage_rows=len(dropped_rows),
        zero_advantage_tokens=sum(lengths[i] for i in dropped_rows),
        zero_advantage_kept=bool(dropped) and kept_all,
        split_groups=sum(n > 1 for n in Counter(u.group for u in units).values()),
        uncentred_parts=sum(u.uncentred for u in chosen),
        rows_per_chunk=real / (len(chunks) * shape.chunk_rows) if chunks else 0.0,
    )


def _groups(rows: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    members: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        if not row.get("placeholder"):
            members[group_key(row)].append(i)
    return members


def _has_advantage(unit: BatchUnit, rows: Sequence[dict[str, Any]]) -> bool:
    return any(unit.advantage.get(i, float(rows[i]["advantage"])) != 0.0 for i in unit.rows)


def _split_group(
    group: str, members: list[int], rows: Sequence[dict[str, Any]], capacity: int
) -> list[BatchUnit]:
    """The group as one unit, or — larger than `capacity` rows — parts of whole sessions dealt in advantage order,
    each recentred on its own mean advantage (module docstring)."""
    if len(members) <= capacity:
        return [BatchUnit(group, members)]
    sessions: dict[str, list[int]] = defaultdict(list)
    for i in members:
        sessions[rows[i]["session_id"]].append(i)
    order = sorted(sessions, key=lambda s: (float(rows[sessions[s][0]]["advantage"]), s))
    parts: list[list[str]] = [[] for _ in range(math.ceil(len(members) / capacity))]
    sizes = [0] * len(parts)
    units: list[BatchUnit] = []
    for n, session in enumerate(order):
        size = len(sessions[session])
        if size > capacity:  # a session larger than a chunk: its parts hold nothing else to recentre against
            for start in range(0, size, capacity):
                units.append(
                    BatchUnit(group, sessions[session][start : start + capacity], {}, uncentred=True)
                )
            continue
        fits = [p for p in range(len(parts)) if sizes[p] + size <= capacity]
        if not fits:
            parts.append([])
            sizes.append(0)
            fits = [len(parts) - 1]
        target = n % len(parts) if n % len(parts) in fits else max(fits, key=lambda p: capacity - sizes[p])
        parts[target].append(session)
        sizes[target] += size
    for part in (p for p in parts if p):
        units.append(_recentred_part(group, [sessions[s] for s in part], rows))
    return units


def _recentred_part(group: str, sessions: list[list[int]], rows: Sequence[dict[str, Any]]) -> BatchUnit:
    """A part of a group, its sessions' advantages minus their mean (each session counted once) — unless they all
    share one advantage (one session, or one reward): recentring would erase their signal, so the part keeps the
    group's advantages (uncentred: its step's mean is not 0)."""
    values = [float(rows[s[0]]["advantage"]) for s in sessions]
    members = [i for s in sessions for i in s]
    if max(values) - min(values) <= ADVANTAGE_TOL * max(1.0, max(abs(v) for v in values)):
        return BatchUnit(group, members, {}, uncentred=values[0] != 0.0)
    mean = sum(values) / len(values)
    return BatchUnit(group, members, {i: v - mean for s, v in zip(sessions, values, strict=True) for i in s})


def _pack_units(units: Sequence[BatchUnit], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First fit in order of mean row length: groups of similar length share a chunk, and a short group may fill
    the room a longer chunk left."""
    order = sorted(
        units, key=lambda u: (sum(lengths[i] for i in u.rows) / max(len(u.rows), 1), u.group, u.rows)
    )
    chunks: list[list[int]] = []
    for unit in order:
        target = next((c for c in chunks if len(c) + len(unit.rows) <= capacity), None)
        if target is None:
            chunks.append(list(unit.rows))
        else:
            target.extend(unit.rows)
    return chunks


def _split_across_processes(chunk: list[int], lengths: Sequence[int], shape: BatchShape) -> list[list[int]]:
    """A chunk's rows over the processes, longest first to the one with the fewest tokens (and a free slot), each
    share then sorted by length."""
    shares: list[list[int]] = [[] for _ in range(shape.processes)]
    tokens = [0] * shape.processes
    for i in sorted(chunk, key=lambda i: (-lengths[i], i)):
        free = [p for p in range(shape.processes) if len(shares[p]) < shape.chunk_slots]
        target = min(free, key=lambda p: (tokens[p], len(shares[p]), p))
        shares[target].append(i)
        tokens[target] += lengths[i]
    return [sorted(share, key=lambda i: (lengths[i], i)) for share in shares]


class GroupBatchSampler:
    """TRL's RepeatSampler contract over a `BatchPlan`: global generation batches of `shape.generation_rows`
    indices, laid out as TRL hands them to the processes (process k gets the k-th `per_device × steps_per_generation`
    indices), each process's part made of its chunk shares, empty slots filled with `placeholder`. Each generation
    batch is yielded `repeat_count` times in a row (TRL reuses it for `steps_per_generation × num_iterations`
    steps); the order of the generation batches is shuffled per epoch, the chunks themselves never change."""

    def __init__(
        self,
        plan: BatchPlan,
        shape: BatchShape,
        placeholder: int,
        *,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.plan, self.shape, self.placeholder = plan, shape, placeholder
        self.repeat_count, self.shuffle, self.seed = repeat_count, shuffle, seed
        self.epoch = 0
        self._epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        """Shuffle for this pass over the data (transformers calls it each epoch, so a resumed run's later passes
        are shuffled as the stopped run's were)."""
        self.epoch, self._epoch_set = epoch, True

    def generation_batches(self) -> list[list[int]]:
        """This epoch's generation batches, as flat index lists."""
        per = self.shape.chunks_per_generation
        groups = [self.plan.chunks[i : i + per] for i in range(0, len(self.plan.chunks), per)]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(groups)
        batches = []
        for chunks in groups:
            batch: list[int] = []
            for process in range(self.shape.processes):
                for chunk in chunks:
                    share = chunk[process]
                    batch += share + [self.placeholder] * (self.shape.chunk_slots - len(share))
            batches.append(batch)
        return batches

    def __iter__(self) -> Iterator[int]:
        batches = self.generation_batches()
        if not self._epoch_set:
            self.epoch += 1
        for batch in batches:
            for _ in range(self.repeat_count):
                yield from batch

    def __len__(self) -> int:
        generations = len(self.plan.chunks) // self.shape.chunks_per_generation
        return generations * self.shape.generation_rows * self.repeat_count


DP_WORK_LIMIT = (
    2_000_000  # rows² × micro-batches beyond which the padded split is balanced instead of optimal
)


def micro_batches(lengths: Sequence[int], count: int, cost: MicroBatchCost = "grid") -> list[list[int]]:
    """Indices into `lengths` cut into exactly `count` micro-batches (empty ones where there are fewer rows), rows
    sorted by length and each micro-batch a run of them. Packed (`tokens`): the split whose largest micro-batch is
    smallest. Padded (`grid`): the split computing the fewest padded tokens among those whose largest micro-batch
    is no larger than in the equal-count split — the memory `per_device_train_batch_size` rows already need (for
    very large shares, the split whose largest padded micro-batch is smallest)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if len(order) <= count:
        return [[i] for i in order] + [[] for _ in range(count - len(order))]
    sizes = [lengths[i] for i in order]
    if cost == "grid" and len(sizes) ** 2 * count <= DP_WORK_LIMIT:
        size = -(-len(order) // count)
        limit = max(len(sizes[k : k + size]) * max(sizes[k : k + size]) for k in range(0, len(sizes), size))
        bounds = _fewest_padded_bounds(sizes, count, limit)
    else:
        bounds = _balanced_bounds(sizes, count, cost)
    return [order[a:b] for a, b in zip([0, *bounds], [*bounds, len(order)], strict=False)][:count]


def _balanced_bounds(sizes: Sequence[int], count: int, cost: MicroBatchCost) -> list[int]:
    """Cut points of ascending `sizes` into `count` runs whose largest cost is smallest (binary search on it)."""
    low, high = max(sizes), len(sizes) * max(sizes)
    while low < high:
        middle = (low + high) // 2
        if len(_greedy_bounds(sizes, middle, cost)) + 1 <= count:
            high = middle
        else:
            low = middle + 1
    bounds = _greedy_bounds(sizes, low, cost)
    spare = [k for k in range(1, len(sizes)) if k not in bounds]  # more, smaller runs cost nothing
    return sorted(bounds + spare[: count - 1 - len(bounds)])


def _greedy_bounds(sizes: Sequence[int], limit: int, cost: MicroBatchCost) -> list[int]:
    """Where runs of ascending `sizes` end when each is grown while its cost stays within `limit`."""
    bounds, start, total = [], 0, 0
    for k, size in enumerate(sizes):
        grown = total + size if cost == "tokens" else (k - start + 1) * size
        if k > start and grown > limit:
            bounds.append(k)
            start, grown = k, size
        total = grown if cost == "tokens" else 0
    return bounds


def _fewest_padded_bounds(sizes: Sequence[int], count: int, limit: int) -> list[int]:
    """Cut points of ascending `sizes` into exactly `count` non-empty runs, each run's rows × its last size at most
    `limit`, with the smallest total (dynamic programming over the runs' ends)."""
    n, inf = len(sizes), float("inf")
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for k in range(1, count + 1):
        for end in range(k, n + 1):
            for start in range(k - 1, end):
                grid = (end - start) * sizes[end - 1]
                if grid <= limit and best[k - 1][start] + grid < best[k][end]:
                    best[k][end], cut[k][end] = best[k - 1][start] + grid, start
    bounds, end = [], n
    for k in range(count, 1, -1):
        end = cut[k][end]
        bounds.append(end)
    return sorted(bounds)


def _cost(part: Sequence[int], lengths: Sequence[int], cost: MicroBatchCost) -> int:
    if cost == "tokens":
        return sum(lengths[i] for i in part)
    return len(part) * max(lengths[i] for i in part)


@dataclass
class MicroBatchPlan:
    """A process's generation batch as its micro-batches: positions into its real rows, in training order (an empty
    micro-batch is a filler: a zero-weight row that keeps every process's step count equal)."""

    micro: list[list[int]]
    packed: bool
    lengths: list[int]  # tokens per real row
    num_items: list[float] = field(default_factory=list)  # per micro-batch: TRL's num_items_in_batch

    def grid(self) -> tuple[int, int]:
        """(real tokens, tokens computed) over the micro-batches; a filler computes its row, for nothing."""
        shortest = min(self.lengths, default=0)
        real = computed = 0
        for part in self.micro:
            if not part:
                computed += shortest
                continue
            real += sum(self.lengths[i] for i in part)
            computed += real_grid(part, self.lengths, self.packed)
        return real, computed


def real_grid(part: Sequence[int], lengths: Sequence[int], packed: bool) -> int:
    """Tokens a micro-batch computes: its tokens when packed, rows × its longest row when padded."""
    return _cost(part, lengths, "tokens" if packed else "grid")


def plan_micro_batches(
    rows: Sequence[dict[str, Any]], chunk_slots: int, per_chunk: int, *, packed: bool
) -> tuple[list[int], MicroBatchPlan]:
    """The real rows of a process's generation batch (positions in `rows`; placeholders leave here) and their
    micro-batches: each chunk of `chunk_slots` rows (as `GroupBatchSampler` laid it out) cut into `per_chunk`."""
    real: list[int] = []
    micro: list[list[int]] = []
    for start in range(0, len(rows), chunk_slots):
        chunk = [
            i for i in range(start, min(start + chunk_slots, len(rows))) if not rows[i].get("placeholder")
        ]
        first = len(real)
        real += chunk
        lengths = [len(rows[i]["input_ids"]) for i in chunk]
        parts = micro_batches(lengths, per_chunk, "tokens" if packed else "grid")
        micro += [[first + j for j in part] for part in parts]
    if not real:  # only placeholders here: one of them stands in, every micro-batch a filler
        real = [0]
    return real, MicroBatchPlan(micro=micro, packed=packed, lengths=[len(rows[i]["input_ids"]) for i in real])
