"""Merged shards → GRPO training rows: one row per sequence of a rewarded session, with its advantage, its turns'
scoring temperatures, and the exclusions and exact truncation applied.

Pure functions on `MergedSequence`s; the only I/O is `load_sequences` (through the merged store, which checks each
row against the contract). The parts live beside this one: advantages.py (group baselines), turn_sampling.py (which
turns the loss can use), stats.py (what went in), batching.py (which rows share an optimizer step: whole groups),
packing.py (micro-batches without padding waste).

A session may span several sequences (per_request sequences, or prefix_merging chains broken by a prefix change):
they all share the session's advantage, and share one unit of weight under per-sequence losses (`session_weight`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from polar_mitm.storage.merged import MergedDataError, MergedSequence, MergedShards
from polar_mitm.train.advantages import (
    AdvantageEstimator,
    GroupAdvantages,
    RewardScaling,
    group_advantages,
    sample_std,
)
from polar_mitm.train.batching import group_key, padding_sources
from polar_mitm.train.stats import DataStats
from polar_mitm.train.turn_sampling import (
    EXCLUDED_CONSTRAINED,
    EXCLUDED_GREEDY,
    EXCLUDED_TRUNCATED,
    TurnSampling,
    exclude_turns,
    temperature_key,
    turn_sampling,
)


def count_ones(mask: Sequence[int]) -> int:
    """How many entries of a 0/1 mask are set, as a Python int: `sum` over an int8 array overflows past 127."""
    return sum(1 for m in mask if m)


def load_sequences(paths: str | Path | Sequence[str | Path]) -> list[MergedSequence]:
    """Read merged shards (folders, shards or URIs: the merged store's) into `MergedSequence`s, checking each row's
    invariants (`MergedDataError`); raises FileNotFoundError where there are no shards."""
    if isinstance(paths, str | Path):
        paths = [paths]
    return [seq for root in paths for seq in MergedShards.at(root).sequences()]


def truncate(seq: MergedSequence, max_length: int | None) -> MergedSequence | None:
    """Keep the exact causal prefix of `max_length` tokens; None if no sampled token survives.

    Ids, mask and logprobs are cut at the same index, so every kept token keeps its own behaviour logprob, and the
    kept tokens see exactly the context they were sampled with.
    """
    if max_length is None or len(seq.input_ids) <= max_length:
        return seq
    if not any(seq.loss_mask[:max_length]):
        return None
    return replace(
        seq,
        input_ids=seq.input_ids[:max_length],
        loss_mask=seq.loss_mask[:max_length],
        logprobs=seq.logprobs[:max_length],
        # finish_reason and end stay the recorded ones: --max-length cuts the training row, not the session
        extra={**seq.extra, "truncated_from": len(seq.input_ids)},
    )


@dataclass
class TrainingData:
    """Training rows (one per sequence, plain Python values) and their stats."""

    rows: list[dict[str, Any]]
    stats: DataStats

    def to_dataset(self, batch_size: int | None = None):
        """A `datasets.Dataset` of the rows for TRL's trainer; with `batch_size`, followed by zero-weight
        placeholders: those that fill the last length bucket (see `padding_sources`), and at least one — index
        `len(rows)`, what `GroupBatchSampler` puts in a chunk's empty slots."""
        from datasets import Dataset

        if not self.rows:
            raise MergedDataError(
                "no trainable sequences (all unrewarded, or nothing sampled within --max-length)"
            )
        lengths = self.lengths()
        sources = padding_sources(lengths, batch_size) if batch_size else []
        if batch_size and not sources:
            sources = [min(range(len(lengths)), key=lambda i: (lengths[i], i))]
        return Dataset.from_list(self.rows + [{**self.rows[i], "placeholder": True} for i in sources])

    def lengths(self) -> list[int]:
        return [len(r["input_ids"]) for r in self.rows]


def build_training_data(
    sequences: Sequence[MergedSequence],
    *,
    estimator: AdvantageEstimator = "mean_std",
    scale_rewards: RewardScaling = "group",
    max_length: int | None = None,
    group_size: int | None = None,
    keep_truncated_sampling: bool = False,
) -> TrainingData:
    """Advantages per session, sampling exclusions, truncation, and one training row per sequence of a rewarded
    session.

    `keep_truncated_sampling` keeps greedy and top-p/top-k/min-p-truncated turns in the loss (see `turn_sampling`
    for why they are left out by default); they are counted either way.
    """
    adv = group_advantages(sequences, estimator=estimator, scale_rewards=scale_rewards)
    stats = _group_stats(sequences, adv, group_size)
    rows: list[dict[str, Any]] = []
    versions: Counter[str] = Counter()
    temperatures: Counter[str] = Counter()
    for seq in sequences:
        if seq.session_id not in adv.reward:
            continue
        turns = turn_sampling(seq)
        if not keep_truncated_sampling:
            seq = _without_excluded_turns(seq, turns, stats)
            if seq is None:
                continue
        kept = truncate(seq, max_length)
        if kept is None or not any(kept.loss_mask):
            stats.dropped_no_sampled_tokens += 1
            continue
        stats.truncated += kept is not seq
        versions[seq.weight_version_min or "unknown"] += 1
        temperatures.update(
            temperature_key(t.temperature) for t in turns if keep_truncated_sampling or not t.excluded
        )
        stats.unknown_temperature_sequences += any(t.temperature is None for t in turns)
        rows.append(_training_row(seq, kept, turns, adv))
    for i, row in enumerate(rows):
        row["row"] = i  # identifies the row (and its placeholder copies) inside the trainer
    stats.sequences_per_session_max = set_session_weights(rows)
    stats.temperatures = dict(sorted(temperatures.items()))
    stats.sequences_used = len(rows)
    stats.tokens = sum(len(r["input_ids"]) for r in rows)
    stats.sampled_tokens = sum(count_ones(r["loss_mask"]) for r in rows)
    rewards = list(adv.reward.values())
    stats.reward_mean = sum(rewards) / len(rewards) if rewards else 0.0
    stats.reward_std = sample_std(rewards)
    stats.weight_versions = dict(sorted(versions.items()))
    _count_zero_advantage_groups(rows, stats)
    return TrainingData(rows=rows, stats=stats)


def _count_zero_advantage_groups(rows: Sequence[dict[str, Any]], stats: DataStats) -> None:
    """Groups (as the batches form them) whose every row has advantage 0: what dynamic sampling leaves out."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(group_key(row), []).append(row)
    flat = [members for members in groups.values() if all(r["advantage"] == 0.0 for r in members)]
    stats.zero_advantage_groups = len(flat)
    stats.zero_advantage_sequences = sum(len(members) for members in flat)
    stats.zero_advantage_tokens = sum(len(r["input_ids"]) for members in flat for r in members)


def _group_stats(
    sequences: Sequence[MergedSequence], adv: GroupAdvantages, group_size: int | None
) -> DataStats:
    """The stats the advantages already decide: sessions, groups and what they left out."""
    stats = DataStats(
        sequences_read=len(sequences),
        sessions=len(adv.group_of),
        groups=len({t for t in adv.group_of.values() if t is not None}),
        unrewarded_sessions=adv.unrewarded_sessions,
        singleton_groups=adv.singleton_groups,
        zero_variance_groups=adv.zero_variance_groups,
        mixed_reward_sessions=adv.mixed_reward_sessions,
        group_sizes=adv.group_sizes,
    )
    if group_size is not None:
        stats.group_size_mismatches = sum(n for size, n in adv.group_sizes.items() if size != group_size)
    return stats


def _training_row(
    seq: MergedSequence, kept: MergedSequence, turns: Sequence[TurnSampling], adv: GroupAdvantages
) -> dict[str, Any]:
    """One training row: `kept` (the truncated `seq`) as plain values, with its session's reward and advantage."""
    return {
        "sequence_id": seq.sequence_id,
        "session_id": seq.session_id,
        "task_id": seq.task_id,
        "input_ids": list(kept.input_ids),
        "loss_mask": list(kept.loss_mask),
        "logprobs": [float(x) if m else 0.0 for x, m in zip(kept.logprobs, kept.loss_mask, strict=True)],
        "prompt_len": kept.prompt_len,
        "reward": adv.reward[seq.session_id],
        "advantage": adv.advantage[seq.session_id],
        # The oldest weights any of its turns was sampled with: how stale the sequence is, at worst.
        "weight_version": seq.weight_version_min,
        "weight_version_max": seq.weight_version_max,
        # Each span of sampled tokens under one weight version (start in input_ids): staleness per token.
        "span_starts": [start for start, _ in seq.version_spans()],
        "span_versions": [version for _, version in seq.version_spans()],
        "turn_starts": [t.start for t in turns],
        "turn_temperatures": [t.temperature for t in turns],
        "session_weight": 1.0,
        "placeholder": False,  # True: a zero-weight copy that only fills the last batch
    }


def _without_excluded_turns(
    seq: MergedSequence, turns: Sequence[TurnSampling], stats: DataStats
) -> MergedSequence | None:
    """`seq` with its excluded turns out of the loss (counted in `stats`); None when nothing trainable is left."""
    excluded = [t for t in turns if t.excluded]
    if not excluded:
        return seq
    stats.excluded_greedy_turns += sum(t.excluded == EXCLUDED_GREEDY for t in excluded)
    stats.excluded_truncated_turns += sum(t.excluded == EXCLUDED_TRUNCATED for t in excluded)
    stats.excluded_constrained_turns += sum(t.excluded == EXCLUDED_CONSTRAINED for t in excluded)
    mask = exclude_turns(seq.loss_mask, turns)
    stats.excluded_sampled_tokens += count_ones(seq.loss_mask) - count_ones(mask)
    if not any(mask):
        stats.dropped_excluded_sampling += 1
        return None
    return replace(seq, loss_mask=mask)


def set_session_weights(rows: list[dict[str, Any]]) -> int:
    """Give each session's rows one unit of weight in total, scaled so the mean row weight is 1 (per-sequence losses
    then keep their scale). Returns the most rows any session has."""
    per_session = Counter(r["session_id"] for r in rows)
    if not per_session:
        return 0
    mean_rows = len(rows) / len(per_session)
    for r in rows:
        r["session_weight"] = mean_rows / per_session[r["session_id"]]
    return max(per_session.values())
