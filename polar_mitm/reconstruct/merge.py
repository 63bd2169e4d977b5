"""`polar-mitm merge`: per-request records (Parquet, local or any pyarrow filesystem URI) → merged shards.

The I/O edge around the pure builders. Two passes over the input keep memory bounded by the sessions that are
interleaved in it, not by the whole data set:

1. read the `session_id` column only, to learn where each session's last record is;
2. stream record batches; buffer each session's records until its last one has been read, then build its
   sequences (`prefix_merging` or `per_request`), check the invariants, decide how the session ended (its rewards
   row and its calls: `storage/session_ends.py`, on every sequence as `end`), join the reward — under that end's
   rule when the caller gives rules (the loop's `--on-*`) — and hand them to the writer, which writes a shard
   whenever enough tokens are buffered.

Inputs are found and read by the records store (`storage/records.py`), shards written by the merged store
(`storage/merged.py`). Output is deterministic: inputs are read in sorted path order, and each shard holds its sequences sorted by
session id then first turn (one shard for moderate inputs, hence fully sorted).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from polar_mitm.reconstruct.fidelity import sequences_fidelity
from polar_mitm.reconstruct.invariants import check_invariants
from polar_mitm.reconstruct.per_request import build_per_request
from polar_mitm.reconstruct.prefix_merging import (
    build_prefix_merging,
    eot_from_last_tokens,
    eot_from_tokenizer,
)
from polar_mitm.reconstruct.turns import (
    BuildResult,
    ListColumn,
    TurnRecord,
    numpy_view,
    prepare_session,
    sequences_to_table,
    turns_from_table,
)
from polar_mitm.storage.engine_info import ENGINE_FILE, read_engine_file
from polar_mitm.storage.location import StorageError
from polar_mitm.storage.merged import MergedSequence, ShardWriter
from polar_mitm.storage.records import Source, list_sources, table_source
from polar_mitm.storage.rewards import Reward, RewardsError, read_rewards
from polar_mitm.storage.session_ends import (
    EndRule,
    EndRules,
    SessionEnd,
    combine,
    end_counts,
    rule_key,
    session_end,
    status_end,
)

Builder = Callable[..., BuildResult]
BUILDERS: dict[str, Builder] = {"prefix_merging": build_prefix_merging, "per_request": build_per_request}


class MergeError(StorageError):
    """Input that merge cannot use (no records, a bad rewards file, an unknown builder, …)."""


# -- end-of-turn token -------------------------------------------------------------------------------------------


def load_tokenizer(spec: str):
    """A Hugging Face tokenizer from a directory, or from a built-in model name (`tiny`, `smollm2`)."""
    from transformers import AutoTokenizer

    from polar_mitm.engine.model_zoo import BUILTIN_MODELS, resolve_model

    path = resolve_model(spec) if spec in BUILTIN_MODELS else Path(spec).expanduser()
    return AutoTokenizer.from_pretrained(str(path))


def shared_tokenizer(spec: str):
    """`load_tokenizer(spec)` once per process while its tokenizer.json stays the same, for read-only use (the
    end-of-turn id, decoding): the loop merges every iteration with the run's one tokenizer and rewrites its report
    after each, and a load (Qwen3's 11 MB tokenizer.json parsed) took 1-1.5 s of a 1.5-5 s merge on the loaded
    2-core machine."""
    tokenizer_file = Path(spec).expanduser() / "tokenizer.json"
    return _cached_tokenizer(spec, tokenizer_file.stat().st_mtime_ns if tokenizer_file.exists() else 0)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(spec: str, modified_ns: int):
    return load_tokenizer(spec)


def resolve_eot(
    eot_token: str | None, tokenizer: str | None, sources: Sequence[Source], inputs: Sequence[str] = ()
) -> tuple[int, str]:
    """The end-of-turn id and where it came from: --eot-token, the tokenizer, what the gateway recorded about its
    engine next to the records (`_engine.json`), or the records themselves."""
    if eot_token is not None and eot_token.strip().lstrip("-").isdigit():
        return int(eot_token), "--eot-token"
    if eot_token is not None:
        if tokenizer is None:
            raise MergeError(f"--eot-token {eot_token!r} is a token text: pass --tokenizer to look up its id")
        vocab = shared_tokenizer(tokenizer).get_vocab()
        if eot_token not in vocab:
            raise MergeError(f"--eot-token {eot_token!r} is not a token of {tokenizer}")
        return int(vocab[eot_token]), f"--eot-token via {tokenizer}"
    if tokenizer is not None:
        return eot_from_tokenizer(shared_tokenizer(tokenizer)), f"tokenizer {tokenizer}"
    recorded = recorded_eot(inputs)
    if recorded is not None:
        return recorded
    last_ids: list[tuple[str, int]] = []
    for source in sources:
        table = source.read(["finish_reason", "completion_ids"])
        completions = ListColumn.from_arrow(table.column("completion_ids"), np.int32)
        ends = completions.offsets[1:]
        has_last = completions.valid & (ends > completions.offsets[:-1])
        reasons = table.column("finish_reason").to_pylist()
        last_ids += [
            (reasons[i] or "", int(completions.values[ends[i] - 1])) for i in np.flatnonzero(has_last)
        ]
    token_id = eot_from_last_tokens(last_ids)
    if token_id is None:
        raise MergeError(
            "cannot detect the end-of-turn token (no record stopped on its own): "
            "pass --eot-token ID or --tokenizer PATH|tiny"
        )
    return token_id, "most common last sampled id"


def recorded_eot(inputs: Sequence[str]) -> tuple[int, str] | None:
    """The end-of-turn id the gateway recorded for these inputs' engine: its renderer's id, else the recorded
    tokenizer's (when that path can be loaded here); None when no input has a usable `_engine.json`."""
    found: dict[int, str] = {}
    for directory in inputs:
        info = read_engine_file(directory)
        if info is None:
            continue
        if isinstance(info.get("eot_token_id"), int):
            found.setdefault(info["eot_token_id"], f"{directory.rstrip('/')}/{ENGINE_FILE}")
        elif info.get("tokenizer_path"):
            try:
                token_id = eot_from_tokenizer(shared_tokenizer(str(info["tokenizer_path"])))
            except (OSError, ValueError):  # a path on the engine's machine, not this one: no answer from it
                continue
            where = f"{directory.rstrip('/')}/{ENGINE_FILE}"
            found.setdefault(token_id, f"tokenizer {info['tokenizer_path']} (from {where})")
    if len(found) > 1:
        raise MergeError(
            f"the inputs were recorded from engines with different end-of-turn ids ({sorted(found)}): "
            "merge them separately, or pass --eot-token ID"
        )
    return next(iter(found.items()), None)


# -- rewards -----------------------------------------------------------------------------------------------------


def load_rewards(uri: str) -> dict[str, Reward]:
    """The rewards file at `uri` by session id (`storage/rewards.py` reads it); a file merge cannot use is a
    MergeError."""
    try:
        return read_rewards(uri)
    except RewardsError as exc:
        raise MergeError(str(exc)) from exc


def join_reward(sequences: list[MergedSequence], reward: Reward | None) -> None:
    """Set the session's reward on its sequences (and its task id where the records had none)."""
    for seq in sequences:
        if reward is None:
            seq.reward = None
            continue
        if reward.task_id is not None and seq.task_id is not None and reward.task_id != seq.task_id:
            raise MergeError(
                f"session {seq.session_id!r}: rewards say task {reward.task_id!r}, "
                f"records say {seq.task_id!r}"
            )
        seq.reward = reward.reward
        seq.task_id = seq.task_id if seq.task_id is not None else reward.task_id


def joined_end(reward: Reward | None, turns: Sequence[TurnRecord]) -> SessionEnd:
    """How a session ended: what its rewards row says (its `end`, else its runner status) and its records' calls."""
    said = None if reward is None else combine(reward.end, status_end(reward.status))
    return session_end(said, turns)


# -- the merge ---------------------------------------------------------------------------------------------------


@dataclass
class MergeSummary:
    """What a merge did; `polar-mitm merge` prints it and writes it to `_summary.json`."""

    builder: str
    eot_token_id: int | None = None
    eot_source: str | None = None
    inputs: int = 0
    records: int = 0
    sessions: int = 0
    trainable_records: int = 0
    excluded: dict[str, int] = field(default_factory=dict)
    sequences: int = 0
    breaks: dict[str, int] = field(default_factory=dict)
    total_tokens: int = 0
    trainable_tokens: int = 0
    rewarded_sessions: int = 0
    unrewarded_sessions: int = 0
    dropped_unrewarded_sequences: int = 0
    # How the sessions ended (storage/session_ends.py), and the rules applied to rewarded ones (`end:rule`, ends other
    # than completed): `mask` left their sequences out (counted in masked_sequences), `zero` gave the failure reward.
    session_ends: dict[str, int] = field(default_factory=dict)
    end_rules: dict[str, int] = field(default_factory=dict)
    masked_sequences: int = 0
    # Reward rows whose session is in no record (a rewards file of another rollout?): counted, the first few named.
    unknown_reward_sessions: int = 0
    unknown_reward_examples: list[str] = field(default_factory=list)
    invariants_checked: bool = True
    # Sampled tokens whose merged context equals their call's recorded prompt (reconstruct/fidelity.py).
    context_exact_tokens: int = 0
    context_checked_tokens: int = 0
    seconds: float = 0.0
    shards: list[str] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # unreadable inputs skipped, one line each

    @property
    def records_per_sequence(self) -> float:
        return self.trainable_records / self.sequences if self.sequences else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "records_per_sequence": round(self.records_per_sequence, 4)}


class _SessionBuffers:
    """Records of sessions not yet complete; rows read from a batch are copied only if their session outlives it."""

    def __init__(self) -> None:
        self.turns: dict[int, list[TurnRecord]] = defaultdict(list)
        self._borrowed: list[tuple[int, int]] = []

    def add(self, code: int, turn: TurnRecord) -> None:
        self._borrowed.append((code, len(self.turns[code])))
        self.turns[code].append(turn)

    def pop(self, code: int) -> list[TurnRecord]:
        return self.turns.pop(code)

    def end_batch(self) -> None:
        for code, index in self._borrowed:
            if code in self.turns:
                self.turns[code][index] = self.turns[code][index].owned()
        self._borrowed.clear()


@dataclass
class SessionIndex:
    """Pass 1's answer: the session of every row (in input order) and the row that completes each session."""

    codes: np.ndarray  # session number of each row
    last_row: np.ndarray  # by session number: the position of its last row

    @property
    def records(self) -> int:
        return len(self.codes)

    @property
    def sessions(self) -> int:
        return len(self.last_row)


def index_sessions(sources: Sequence[Source]) -> SessionIndex:
    """Pass 1: read the `session_id` column only, to learn where each session's last record is."""
    session_names: dict[str, int] = {}
    code_parts = []
    for source in sources:
        column = source.read(["session_id"]).column(0)
        if column.null_count:
            raise MergeError(f"{source.name}: {column.null_count} record(s) without a session_id")
        encoded = pc.dictionary_encode(column).combine_chunks()
        lookup = np.array(
            [session_names.setdefault(s, len(session_names)) for s in encoded.dictionary.to_pylist()],
            dtype=np.int64,
        )
        indices = numpy_view(encoded.indices.cast(pa.int64()), np.int64)
        code_parts.append(lookup[indices] if len(lookup) else np.zeros(0, np.int64))
    codes = np.concatenate(code_parts) if code_parts else np.zeros(0, np.int64)
    last_row = np.full(len(session_names), -1, dtype=np.int64)
    np.maximum.at(last_row, codes, np.arange(len(codes)))
    return SessionIndex(codes=codes, last_row=last_row)


def complete_sessions(
    sources: Sequence[Source],
    index: SessionIndex,
    *,
    batch_rows: int = 256,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[list[TurnRecord]]:
    """Pass 2: stream the rows; yield each session's records as soon as its last one has been read.

    A yielded session must be used before the next is asked for: its rows may still point into the batch.
    """
    buffers = _SessionBuffers()
    row = 0
    for source in sources:
        for batch in source.batches(batch_rows):
            for turn in turns_from_table(batch, first_position=row):
                code = int(index.codes[turn.position])
                buffers.add(code, turn)
                if index.last_row[code] == turn.position:
                    yield buffers.pop(code)
            buffers.end_batch()
            row += batch.num_rows
            if on_progress is not None:
                on_progress(batch.num_rows)
    if buffers.turns:
        raise MergeError(
            f"{len(buffers.turns)} session(s) were never completed: the input changed while read"
        )


class _SessionMerger:
    """Pass 2's work on each completed session: build, check, join the reward, count; hand finished sequences to
    `sink` in sorted groups of about `flush_tokens` tokens."""

    def __init__(
        self,
        summary: MergeSummary,
        sink: Callable[[list[MergedSequence]], None],
        *,
        build: Builder,
        eot_token_id: int | None,
        rewards: dict[str, Reward] | None,
        drop_unrewarded: bool,
        check: bool,
        flush_tokens: int,
        end_rules: EndRules | None = None,
    ) -> None:
        self.summary, self.sink, self.build, self.eot_token_id = summary, sink, build, eot_token_id
        self.rewards, self.drop_unrewarded, self.check, self.flush_tokens = (
            rewards,
            drop_unrewarded,
            check,
            flush_tokens,
        )
        self.end_rules = end_rules
        self.ends: Counter[str] = Counter()
        self.rules_applied: Counter[str] = Counter()
        self.excluded: Counter[str] = Counter()
        self.breaks: Counter[str] = Counter()
        self.pending: list[MergedSequence] = []
        self.pending_tokens = 0
        self.seen_sessions: set[str] = set()

    def note_unknown_rewards(self) -> None:
        """Count (and name a few of) the reward rows no session of the records matched."""
        # (a row without a reward, e.g. a cut session stopped before its first call, joins nothing: not named)
        rewarded = {sid for sid, row in (self.rewards or {}).items() if row.reward is not None}
        unknown = sorted(rewarded - self.seen_sessions)
        self.summary.unknown_reward_sessions = len(unknown)
        self.summary.unknown_reward_examples = unknown[:5]

    def flush(self) -> None:
        if self.pending:
            # Stable sort: a session's sequences stay in first-turn order.
            self.sink(sorted(self.pending, key=lambda s: s.session_id))
        self.pending, self.pending_tokens = [], 0

    def add(self, session_turns: list[TurnRecord]) -> None:
        summary = self.summary
        if not session_turns:
            return
        session_id = session_turns[0].session_id
        self.seen_sessions.add(session_id)
        reward = (self.rewards or {}).get(session_id)
        end = joined_end(reward, session_turns)  # every record counts: an error record may be the last call
        self.ends[end] += 1
        kept, left_out = prepare_session(session_turns)
        self.excluded.update(left_out)
        if not kept:
            return
        result = self.build(kept, eot_token_id=self.eot_token_id)
        if self.check:
            check_invariants(session_turns, result.sequences)
        self.breaks.update(result.breaks)
        for seq in result.sequences:
            seq.end = end
        rewarded = reward is not None and reward.reward is not None
        if self.rewards is not None:
            summary.rewarded_sessions += rewarded
            summary.unrewarded_sessions += not rewarded
        if not rewarded and self.drop_unrewarded:
            summary.dropped_unrewarded_sequences += len(result.sequences)
            return
        if rewarded and self.end_rules is not None:
            reward = self._ruled(reward, end, len(result.sequences))  # type: ignore[arg-type]
            if reward is None:
                return
        join_reward(result.sequences, reward)
        fidelity = sequences_fidelity(result.sequences, {t.request_id: t.prompt_ids for t in kept})
        summary.context_exact_tokens += fidelity.exact_tokens
        summary.context_checked_tokens += fidelity.sampled_tokens
        summary.trainable_records += len(kept)
        summary.sequences += len(result.sequences)
        for seq in result.sequences:
            summary.total_tokens += len(seq.input_ids)
            summary.trainable_tokens += int(np.count_nonzero(seq.loss_mask))
            self.pending_tokens += len(seq.input_ids)
        self.pending.extend(result.sequences)
        if self.pending_tokens >= self.flush_tokens:
            self.flush()

    def _ruled(self, reward: Reward, end: SessionEnd, sequences: int) -> Reward | None:
        """A rewarded session's reward under its end's rule (None: masked, its `sequences` left out), counted."""
        assert self.end_rules is not None and reward.reward is not None
        rule = self.end_rules.rule(end)
        if end is not SessionEnd.COMPLETED:
            self.rules_applied[rule_key(end, rule)] += 1
        if rule is EndRule.mask:
            self.summary.masked_sequences += sequences
            return None
        return dataclasses.replace(reward, reward=self.end_rules.reward(end, reward.reward))


def merge_sources(
    sources: Sequence[Source],
    sink: Callable[[list[MergedSequence]], None],
    *,
    builder: str = "prefix_merging",
    eot_token_id: int | None = None,
    rewards: dict[str, Reward] | None = None,
    drop_unrewarded: bool = False,
    end_rules: EndRules | None = None,
    check: bool = True,
    batch_rows: int = 256,
    flush_tokens: int = 16 << 20,
    on_progress: Callable[[int], None] | None = None,
) -> MergeSummary:
    """Stream `sources` through a builder (the two passes of the module docstring); `sink` receives sorted groups
    of finished sequences. `end_rules`: what each way a rewarded session ended does to its reward (mask: left
    out; zero: the failure reward), counted in the summary."""
    if builder not in BUILDERS:
        raise MergeError(f"unknown builder {builder!r}; choose from {', '.join(BUILDERS)}")
    if builder == "prefix_merging" and eot_token_id is None:
        raise MergeError("prefix_merging needs the end-of-turn token id")
    started = time.perf_counter()
    summary = MergeSummary(
        builder=builder, eot_token_id=eot_token_id, inputs=len(sources), invariants_checked=check
    )
    index = index_sessions(sources)
    summary.records, summary.sessions = index.records, index.sessions
    merger = _SessionMerger(
        summary,
        sink,
        build=BUILDERS[builder],
        eot_token_id=eot_token_id,
        rewards=rewards,
        drop_unrewarded=drop_unrewarded,
        check=check,
        flush_tokens=flush_tokens,
        end_rules=end_rules,
    )
    for session_turns in complete_sessions(sources, index, batch_rows=batch_rows, on_progress=on_progress):
        merger.add(session_turns)
    merger.flush()
    merger.note_unknown_rewards()
    summary.excluded = dict(sorted(merger.excluded.items()))
    summary.breaks = dict(sorted(merger.breaks.items()))
    summary.session_ends = end_counts(list(merger.ends.elements()))
    summary.end_rules = dict(sorted(merger.rules_applied.items()))
    summary.seconds = time.perf_counter() - started
    return summary


def merge(
    inputs: Sequence[str],
    output: str,
    *,
    builder: str = "prefix_merging",
    rewards: str | None = None,
    eot_token: str | None = None,
    tokenizer: str | None = None,
    drop_unrewarded: bool = False,
    end_rules: EndRules | None = None,
    check: bool = True,
    batch_rows: int = 256,
    flush_tokens: int = 16 << 20,
    on_start: Callable[[int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> MergeSummary:
    """Merge the records under `inputs` into Parquet shards under `output` (see the module docstring)."""
    started = time.perf_counter()
    if builder not in BUILDERS:
        raise MergeError(f"unknown builder {builder!r}; choose from {', '.join(BUILDERS)}")
    found = list_sources(inputs)
    sources = found.sources
    if not sources:
        why = f" (skipped: {'; '.join(found.problems)})" if found.problems else ""
        raise MergeError(f"no records found under {', '.join(inputs)}{why}")
    # per_request needs no end-of-turn token: do not load a tokenizer (or scan completions) for nothing.
    needs_eot = builder != "per_request" or eot_token is not None
    eot_token_id, eot_source = (
        resolve_eot(eot_token, tokenizer, sources, inputs) if needs_eot else (None, None)
    )
    reward_table = load_rewards(rewards) if rewards else None
    if drop_unrewarded and reward_table is None:
        raise MergeError("--drop-unrewarded needs --rewards")
    writer = ShardWriter(output)
    if on_start is not None:
        on_start(sum(s.num_rows for s in sources))
    summary = merge_sources(
        sources,
        lambda group: writer.write(sequences_to_table(group)),
        builder=builder,
        eot_token_id=eot_token_id,
        rewards=reward_table,
        drop_unrewarded=drop_unrewarded,
        end_rules=end_rules,
        check=check,
        batch_rows=batch_rows,
        flush_tokens=flush_tokens,
        on_progress=on_progress,
    )
    summary.eot_source, summary.shards, summary.skipped_files = eot_source, writer.shards, found.skipped
    summary.problems = found.problems
    summary.seconds = time.perf_counter() - started  # the whole run: listing, end-of-turn detection, merge
    writer.write_summary(summary.to_json())
    return summary


def merge_table(
    records: pa.Table,
    *,
    builder: str = "prefix_merging",
    eot_token_id: int | None = None,
    rewards: dict[str, Reward] | None = None,
    drop_unrewarded: bool = False,
    end_rules: EndRules | None = None,
    check: bool = True,
) -> tuple[pa.Table, MergeSummary]:
    """In-memory merge of a records table (same path as `merge`, one output table)."""
    groups: list[list[MergedSequence]] = []
    summary = merge_sources(
        [table_source(records)],
        groups.append,
        builder=builder,
        eot_token_id=eot_token_id,
        rewards=rewards,
        drop_unrewarded=drop_unrewarded,
        end_rules=end_rules,
        check=check,
        flush_tokens=1 << 62,
    )
    return sequences_to_table([s for group in groups for s in group]), summary
