"""Merged shards → GRPO training rows: groups by `task_id`, group-relative advantages, exact truncation, batching.

Pure functions on `MergedSequence`s; the only I/O is `read_merged` (through the merged store). Rewards are fixed once recorded, so the group
baseline is computed here over whole groups, before training — not inside a batch, where a group may be split.

A GRPO group is a `task_id`; its members are sessions (one rollout each). A session may span several sequences
(per_request sequences, or prefix_merging chains broken by a prefix change): they all share the session's advantage,
and share one unit of weight under per-sequence losses (`session_weight`).

Each merged call ("turn") keeps the sampling parameters it was sampled with (MERGED_SCHEMA v2): the trainer scores
its tokens at its own temperature, and leaves greedy or top-p/top-k/min-p-truncated turns out of the loss by default
(their recorded logprobs are not the probabilities of the distribution that sampled them).
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from polar_mitm.greedy import GREEDY_SCORING_TEMPERATURE, is_greedy
from polar_mitm.storage.merged import MERGED_SCHEMA, MERGED_SCHEMA_VERSION, MergedSequence, MergedShards

AdvantageEstimator = Literal["mean_std", "leave_one_out"]
RewardScaling = Literal["group", "batch", "none"]
STD_EPS = 1e-4  # as TRL: keeps a near-zero-variance group from blowing up
ZERO_VARIANCE_TOL = 1e-9


class MergedDataError(ValueError):
    """Merged shards that break MERGED_SCHEMA's invariants (and so cannot be trained on safely)."""


# -- reading ---------------------------------------------------------------------------------------------------------


def read_merged(paths: str | Path | Sequence[str | Path]) -> list[MergedSequence]:
    """Read merged shards (folders, shards or URIs: the merged store's) into `MergedSequence`s, checking each row's
    invariants; raises FileNotFoundError where there are no shards."""
    if isinstance(paths, str | Path):
        paths = [paths]
    names = {f.name for f in MERGED_SCHEMA}
    sequences: list[MergedSequence] = []
    for root in paths:
        for file, table in MergedShards.at(root).tables():
            missing = {"input_ids", "loss_mask", "logprobs", "session_id"} - set(table.column_names)
            if missing:
                raise MergedDataError(f"{file}: not a merged shard (missing columns {sorted(missing)})")
            for row in table.to_pylist():
                version = row.get("schema_version") or MERGED_SCHEMA_VERSION
                if version > MERGED_SCHEMA_VERSION:
                    raise MergedDataError(f"{file}: merged schema v{version} is newer than this reader "
                                          f"(v{MERGED_SCHEMA_VERSION})")
                seq = MergedSequence(**{k: v for k, v in row.items() if k in names})
                validate_sequence(seq, where=file)
                sequences.append(seq)
    return sequences


def validate_sequence(seq: MergedSequence, *, where: str = "") -> None:
    """Raise `MergedDataError` unless ids, mask and logprobs align and the logprobs are usable as ratios."""
    at = f"{where}: sequence {seq.sequence_id}" if where else f"sequence {seq.sequence_id}"
    n = len(seq.input_ids)
    if not (len(seq.loss_mask) == len(seq.logprobs) == n):
        raise MergedDataError(f"{at}: input_ids/loss_mask/logprobs lengths differ "
                              f"({n}/{len(seq.loss_mask)}/{len(seq.logprobs)})")
    if not 1 <= seq.prompt_len <= n:
        raise MergedDataError(f"{at}: prompt_len={seq.prompt_len} outside [1, {n}]")
    if any(seq.loss_mask[: seq.prompt_len]):
        raise MergedDataError(f"{at}: a sampled token (loss_mask 1) inside the prompt (prompt_len={seq.prompt_len})")
    mask = np.asarray(seq.loss_mask)
    logprobs = np.asarray(seq.logprobs, dtype=np.float64)
    bad_mask = np.flatnonzero((mask != 0) & (mask != 1))
    if bad_mask.size:
        i = int(bad_mask[0])
        raise MergedDataError(f"{at}: loss_mask[{i}]={seq.loss_mask[i]} is not 0/1")
    if seq.turn_starts is not None:
        starts = list(seq.turn_starts)
        if starts != sorted(starts) or not all(seq.prompt_len <= s < n for s in starts):
            raise MergedDataError(f"{at}: turn_starts {starts[:8]} not increasing within [prompt_len, {n})")
        for name in ("turn_temperature", "turn_top_p", "turn_top_k", "turn_min_p", "turn_greedy", "turn_constrained"):
            values = getattr(seq, name)
            if values is not None and len(values) != len(starts):
                raise MergedDataError(f"{at}: {name} has {len(values)} values for {len(starts)} turns")
    sampled = mask == 1
    bad_logprob = np.flatnonzero(sampled & ~(np.isfinite(logprobs) & (logprobs <= 1e-6)))
    if bad_logprob.size:
        i = int(bad_logprob[0])
        raise MergedDataError(f"{at}: logprob[{i}]={seq.logprobs[i]} is not a finite log-probability")


# -- advantages ------------------------------------------------------------------------------------------------------


@dataclass
class GroupAdvantages:
    """Per-session rewards and advantages, plus what was left out and why."""

    reward: dict[str, float]
    advantage: dict[str, float]
    group_of: dict[str, str | None]
    zero_variance_groups: int = 0
    singleton_groups: int = 0
    unrewarded_sessions: int = 0
    mixed_reward_sessions: int = 0
    group_sizes: dict[int, int] = field(default_factory=dict)  # sessions per group → number of groups


def session_rewards(sequences: Sequence[MergedSequence]) -> tuple[dict[str, float], dict[str, str | None], int]:
    """One reward and group per session: (reward by session, task_id by session, sessions whose rows disagree).

    Rewards are joined per session, so its rows should agree; if they do not, the mean is used and counted.
    """
    rewards: dict[str, list[float]] = defaultdict(list)
    group_of: dict[str, str | None] = {}
    for seq in sequences:
        group_of.setdefault(seq.session_id, seq.task_id)
        if seq.reward is not None and math.isfinite(seq.reward):
            rewards[seq.session_id].append(float(seq.reward))
    mixed = sum(1 for values in rewards.values() if max(values) - min(values) > ZERO_VARIANCE_TOL)
    return {s: sum(v) / len(v) for s, v in rewards.items()}, group_of, mixed


def group_advantages(
    sequences: Sequence[MergedSequence],
    *,
    estimator: AdvantageEstimator = "mean_std",
    scale_rewards: RewardScaling = "group",
) -> GroupAdvantages:
    """Group-relative advantages per session, over the sessions of each `task_id`.

    `mean_std`: (r - group mean), divided by the group std (`scale_rewards="group"`, TRL's default), by the std of
    all rewards (`"batch"`) or not at all (`"none"`, Dr. GRPO). `leave_one_out` (RLOO): r - mean of the *other*
    sessions' rewards, unscaled. Groups whose rewards are all equal, and single-session groups, get exactly 0.
    Sessions without a task_id are their own (singleton) group; sessions without a reward are left out.
    """
    if estimator not in ("mean_std", "leave_one_out") or scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"unknown advantage estimator {estimator!r} or reward scaling {scale_rewards!r}")
    reward, group_of, mixed = session_rewards(sequences)
    members: dict[str, list[str]] = defaultdict(list)
    singleton = 0
    for session in reward:
        task = group_of[session]
        if task is None:
            singleton += 1
            continue
        members[task].append(session)
    all_rewards = list(reward.values())
    batch_std = _std(all_rewards)
    advantage = {s: 0.0 for s in reward}
    zero_variance = 0
    for sessions in members.values():
        values = [reward[s] for s in sessions]
        if len(values) < 2:
            singleton += 1
            continue
        if max(values) - min(values) <= ZERO_VARIANCE_TOL:
            zero_variance += 1  # an exact 0: float noise in (r - mean) / eps would otherwise leak a gradient
            continue
        total, n = sum(values), len(values)
        scale = {"group": _std(values), "batch": batch_std, "none": None}[scale_rewards]
        for s, r in zip(sessions, values, strict=True):
            if estimator == "leave_one_out":
                advantage[s] = r - (total - r) / (n - 1)
            else:
                advantage[s] = (r - total / n) / (scale + STD_EPS) if scale is not None else r - total / n
    sizes = Counter(len(v) for v in members.values())
    return GroupAdvantages(
        reward=reward, advantage=advantage, group_of=group_of, zero_variance_groups=zero_variance,
        singleton_groups=singleton, unrewarded_sessions=len(group_of) - len(reward), mixed_reward_sessions=mixed,
        group_sizes=dict(sorted(sizes.items())),
    )


def _std(values: Sequence[float]) -> float:
    """Sample standard deviation (Bessel-corrected, like TRL's `nanstd`); 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


# -- truncation ------------------------------------------------------------------------------------------------------


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
        finish_reason="truncated",
        extra={**seq.extra, "truncated_from": len(seq.input_ids)},
    )


# -- sampling parameters per turn -----------------------------------------------------------------------------------

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
        truncated = ((top_p[k] is not None and top_p[k] < 1.0) or (top_k[k] is not None and top_k[k] > 0)
                     or (min_p[k] is not None and min_p[k] > 0.0))
        excluded = (EXCLUDED_GREEDY if greedy_turn else EXCLUDED_TRUNCATED if truncated
                    else EXCLUDED_CONSTRAINED if constrained[k] else None)
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
        mask[turn.start:end] = [0] * (end - turn.start)
    return mask


def temperature_key(temperature: float | None) -> str:
    """How a temperature is counted in the data summary ("0.7"; "unknown" for v1 data)."""
    return "unknown" if temperature is None else f"{temperature:.6g}"


def token_temperatures(turn_starts: Sequence[int], turn_temperatures: Sequence[float | None], length: int,
                       default: float) -> list[float]:
    """The scoring temperature of every token of a row: its turn's (`default` where unknown). Tokens before the first
    turn (the prompt) take the first turn's: they are never scored for the loss."""
    temps = [default if t is None else float(t) for t in turn_temperatures] or [default]
    out = [temps[0]] * length
    for k, start in enumerate(turn_starts):
        end = turn_starts[k + 1] if k + 1 < len(turn_starts) else length
        out[start:end] = [temps[k]] * max(0, min(end, length) - start)
    return out


# -- training rows ---------------------------------------------------------------------------------------------------


@dataclass
class DataStats:
    """What went into training and what was left out (written next to the run as data_stats.json)."""

    sequences_read: int = 0
    sequences_used: int = 0
    sessions: int = 0
    groups: int = 0
    unrewarded_sessions: int = 0
    singleton_groups: int = 0
    zero_variance_groups: int = 0
    mixed_reward_sessions: int = 0
    truncated: int = 0
    dropped_no_sampled_tokens: int = 0
    group_sizes: dict[int, int] = field(default_factory=dict)
    group_size_mismatches: int = 0
    tokens: int = 0
    sampled_tokens: int = 0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    weight_versions: dict[str, int] = field(default_factory=dict)
    # Sampling: turns per scoring temperature ("unknown": v1 data, scored at the trainer's --temperature), and what
    # left the loss because its logprobs are not the sampling policy's (greedy / top-p, top-k, min-p truncation).
    temperatures: dict[str, int] = field(default_factory=dict)
    unknown_temperature_sequences: int = 0
    excluded_greedy_turns: int = 0
    excluded_truncated_turns: int = 0
    excluded_constrained_turns: int = 0
    excluded_sampled_tokens: int = 0
    dropped_excluded_sampling: int = 0  # sequences with no sampled token left after the exclusions
    sequences_per_session_max: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrainingData:
    """Training rows (one per sequence, plain Python values) and their stats."""

    rows: list[dict[str, Any]]
    stats: DataStats

    def to_dataset(self, batch_size: int | None = None):
        """A `datasets.Dataset` of the rows for TRL's trainer; with `batch_size`, followed by the zero-weight
        placeholders that fill the last length bucket (see `padding_sources`)."""
        from datasets import Dataset

        if not self.rows:
            raise MergedDataError("no trainable sequences (all unrewarded, or nothing sampled within --max-length)")
        sources = padding_sources(self.lengths(), batch_size) if batch_size else []
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
    stats = DataStats(
        sequences_read=len(sequences), sessions=len(adv.group_of),
        groups=len({t for t in adv.group_of.values() if t is not None}),
        unrewarded_sessions=adv.unrewarded_sessions, singleton_groups=adv.singleton_groups,
        zero_variance_groups=adv.zero_variance_groups, mixed_reward_sessions=adv.mixed_reward_sessions,
        group_sizes=adv.group_sizes,
    )
    if group_size is not None:
        stats.group_size_mismatches = sum(n for size, n in adv.group_sizes.items() if size != group_size)
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
        temperatures.update(temperature_key(t.temperature) for t in turns if keep_truncated_sampling or not t.excluded)
        stats.unknown_temperature_sequences += any(t.temperature is None for t in turns)
        rows.append({
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
            "turn_starts": [t.start for t in turns],
            "turn_temperatures": [t.temperature for t in turns],
            "session_weight": 1.0,
            "placeholder": False,  # True: a zero-weight copy that only fills the last batch
        })
    for i, row in enumerate(rows):
        row["row"] = i  # identifies the row (and its placeholder copies) inside the trainer
    stats.sequences_per_session_max = set_session_weights(rows)
    stats.temperatures = dict(sorted(temperatures.items()))
    stats.sequences_used = len(rows)
    stats.tokens = sum(len(r["input_ids"]) for r in rows)
    stats.sampled_tokens = sum(sum(r["loss_mask"]) for r in rows)
    rewards = list(adv.reward.values())
    stats.reward_mean = sum(rewards) / len(rewards) if rewards else 0.0
    stats.reward_std = _std(rewards)
    stats.weight_versions = dict(sorted(versions.items()))
    return TrainingData(rows=rows, stats=stats)


def _without_excluded_turns(seq: MergedSequence, turns: Sequence[TurnSampling],
                            stats: DataStats) -> MergedSequence | None:
    """`seq` with its excluded turns out of the loss (counted in `stats`); None when nothing trainable is left."""
    excluded = [t for t in turns if t.excluded]
    if not excluded:
        return seq
    stats.excluded_greedy_turns += sum(t.excluded == EXCLUDED_GREEDY for t in excluded)
    stats.excluded_truncated_turns += sum(t.excluded == EXCLUDED_TRUNCATED for t in excluded)
    stats.excluded_constrained_turns += sum(t.excluded == EXCLUDED_CONSTRAINED for t in excluded)
    mask = exclude_turns(seq.loss_mask, turns)
    stats.excluded_sampled_tokens += int(sum(seq.loss_mask)) - sum(mask)
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


def newest_weight_version(rows: Sequence[dict[str, Any]]) -> str | None:
    """The newest `weight_version_max` among the rows (numeric versions compare as numbers)."""
    versions = {r.get("weight_version_max") or r.get("weight_version") for r in rows} - {None}
    if not versions:
        return None
    numeric = [v for v in versions if str(v).isdigit()]
    return max(numeric, key=int) if numeric else sorted(versions)[-1]


def version_distance(current: str | None, recorded: str | None) -> int:
    """How many weight updates separate `recorded` from `current`: the difference of numeric versions, else 0 if
    they are equal (or unknown) and 1 if they differ."""
    if current is None or recorded is None or current == recorded:
        return 0
    if str(current).isdigit() and str(recorded).isdigit():
        return max(0, int(current) - int(recorded))
    return 1


# -- batching --------------------------------------------------------------------------------------------------------


def collate(rows: Sequence[dict[str, Any]], pad_token_id: int, default_temperature: float = 1.0) -> dict[str, Any]:
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
        temperature[i, :tail] = torch.tensor(token_temperatures(starts, temps, length, default_temperature)[split:])
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
        "session_weight": torch.tensor([float(r.get("session_weight", 1.0)) for r in rows], dtype=torch.float32),
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
        return order[full - short:full]
    return [order[i % n] for i in range(short)]  # fewer rows than a batch: repeats are unavoidable


def length_buckets(lengths: Sequence[int], batch_size: int, *, seed: int = 0, shuffle: bool = True) -> list[list[int]]:
    """Indices grouped into batches of similar length (sorted, chunked; the chunk order shuffled).

    Every row is in exactly one batch. The last batch is filled up to `batch_size` rows (TRL splits a generation batch
    evenly across accumulation steps) with placeholders — indices `len(lengths) + j`, zero-weight copies of
    `padding_sources(...)[j]` — so no row is used more often than the others.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if not order:
        return []
    chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
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

    def __init__(self, lengths: Sequence[int], batch_size: int, *, repeat_count: int = 1, shuffle: bool = True,
                 seed: int = 0) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        chunks = length_buckets(self.lengths, self.batch_size, seed=self.seed + self.epoch, shuffle=self.shuffle)
        self.epoch += 1
        for chunk in chunks:
            for _ in range(self.repeat_count):
                yield from chunk

    def __len__(self) -> int:
        n_chunks = math.ceil(len(self.lengths) / self.batch_size)
        return n_chunks * self.batch_size * self.repeat_count
