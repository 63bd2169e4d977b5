"""Token-faithfulness invariants of merged sequences, checked against the records they were built from.

For any builder:
1. every trainable record (see `turns.prepare_session`) appears in exactly one sequence, and no other record
   does; a sequence's turns are in session order;
2. each turn's sampled ids appear, in order, as a mask-1 run carrying exactly (bit for bit) the recorded
   logprobs; every other token has mask 0 and logprob 0.0;
3. a sequence starts with its first turn's whole prompt, and the context between two turns' sampled ids is a
   tail of the later turn's recorded prompt;
4. `input_ids`, `loss_mask` and `logprobs` have one length; `prompt_len`, `n_turns` and `finish_reason` agree.

Determinism (the same input gives the same output) is a property of the builders, checked by the tests.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from polar_mitm.reconstruct.turns import TurnRecord, prepare_session, sequences_from_table, turns_from_table
from polar_mitm.storage.merged import MergedSequence


class InvariantError(ValueError):
    """Merged output that is not token-faithful to its records; says which sequence, turn and position."""

    def __init__(
        self, message: str, *, sequence_id: str | None = None, request_id: str | None = None
    ) -> None:
        where = ", ".join(
            part
            for part in (
                f"sequence {sequence_id!r}" if sequence_id else "",
                f"request {request_id!r}" if request_id else "",
            )
            if part
        )
        super().__init__(f"{where}: {message}" if where else message)
        self.sequence_id = sequence_id
        self.request_id = request_id


def check_invariants(
    records: pa.Table | Iterable[TurnRecord], sequences: pa.Table | Iterable[MergedSequence]
) -> None:
    """Raise InvariantError unless `sequences` are a token-faithful, complete rendering of `records`.

    `records` may hold error, abort, malformed and duplicate records: they are filtered the way merge filters
    them. `sequences` must be all the sequences built from those records (e.g. one session's).
    """
    turns = turns_from_table(records) if isinstance(records, pa.Table) else list(records)
    seqs = sequences_from_table(sequences) if isinstance(sequences, pa.Table) else list(sequences)
    by_session: dict[str, list[TurnRecord]] = defaultdict(list)
    for turn in turns:
        by_session[turn.session_id].append(turn)
    trainable: dict[tuple[str, str], TurnRecord] = {}
    for session_turns in by_session.values():
        kept, _ = prepare_session(session_turns)
        trainable.update(((t.session_id, t.request_id), t) for t in kept)
    known = {(t.session_id, t.request_id) for t in turns}

    placed: dict[tuple[str, str], str] = {}
    for seq in seqs:
        for request_id in seq.request_ids:
            key = (seq.session_id, request_id)
            if key in placed:
                raise InvariantError(
                    f"appears twice (also in {placed[key]!r})",
                    sequence_id=seq.sequence_id,
                    request_id=request_id,
                )
            if key not in trainable:
                why = "is excluded (error, abort, duplicate or malformed)" if key in known else "is unknown"
                raise InvariantError(
                    f"record {why} but was merged", sequence_id=seq.sequence_id, request_id=request_id
                )
            placed[key] = seq.sequence_id
        _check_sequence(seq, [trainable[(seq.session_id, r)] for r in seq.request_ids])
    missing = [key for key in trainable if key not in placed]
    if missing:
        session_id, request_id = missing[0]
        raise InvariantError(
            f"{len(missing)} trainable record(s) in no sequence (first of session {session_id!r})",
            request_id=request_id,
        )


def _check_sequence(seq: MergedSequence, turns: list[TurnRecord]) -> None:
    def fail(message: str, turn: TurnRecord | None = None) -> InvariantError:
        return InvariantError(
            message, sequence_id=seq.sequence_id, request_id=turn.request_id if turn else None
        )

    ids, mask, logprobs = (np.asarray(a) for a in (seq.input_ids, seq.loss_mask, seq.logprobs))
    if not len(ids) == len(mask) == len(logprobs):
        raise fail(f"lengths differ: input_ids {len(ids)}, loss_mask {len(mask)}, logprobs {len(logprobs)}")
    if not turns or seq.n_turns != len(turns):
        raise fail(f"n_turns is {seq.n_turns} but {len(turns)} request ids are listed")
    if np.any((mask != 0) & (mask != 1)):
        raise fail("loss_mask holds values other than 0 and 1")
    context = mask == 0
    if np.any(logprobs[context] != 0.0):
        at = int(np.flatnonzero(context & (logprobs != 0.0))[0])
        raise fail(f"mask-0 token at {at} carries logprob {logprobs[at]!r} (must be 0.0)")
    keys = [t.sort_key()[:2] for t in turns]
    if keys != sorted(keys):
        raise fail("turns are not in session (seq) order")

    first = turns[0]
    prompt = first.prompt_ids
    if seq.prompt_len != len(prompt):
        raise fail(f"prompt_len {seq.prompt_len} != first prompt length {len(prompt)}", first)
    if len(ids) < len(prompt) or not np.array_equal(ids[: len(prompt)], prompt) or mask[: len(prompt)].any():
        raise fail("does not start with its first turn's whole prompt at mask 0", first)
    pos = len(prompt)
    for k, turn in enumerate(turns):
        if k > 0:
            ahead = mask[pos:] == 1
            n_context = int(ahead.argmax()) if ahead.any() else -1
            if n_context < 0:
                raise fail(f"turn {k}: no sampled ids after position {pos}", turn)
            prompt = turn.prompt_ids
            if n_context > len(prompt) or not np.array_equal(
                ids[pos : pos + n_context], prompt[len(prompt) - n_context :]
            ):
                raise fail(
                    f"turn {k}: the {n_context} context tokens at {pos} are not a tail of its prompt", turn
                )
            pos += n_context
        sampled, recorded = turn.completion_ids, turn.completion_logprobs
        end = pos + len(sampled)
        if end > len(ids) or not np.array_equal(ids[pos:end], sampled):
            raise fail(f"turn {k}: sampled ids not found at {pos}", turn)
        if not mask[pos:end].all():
            raise fail(f"turn {k}: sampled ids at {pos} are not all mask 1", turn)
        got = np.ascontiguousarray(logprobs[pos:end], dtype=np.float32).view(np.uint32)
        want = np.ascontiguousarray(recorded, dtype=np.float32).view(np.uint32)
        if not np.array_equal(got, want):
            at = pos + int(np.flatnonzero(got != want)[0])
            raise fail(f"turn {k}: logprob at {at} differs from the recorded one", turn)
        pos = end
    if pos != len(ids):
        raise fail(f"{len(ids) - pos} tokens after the last turn's sampled ids")
    if seq.finish_reason != turns[-1].finish_reason:
        raise fail(f"finish_reason {seq.finish_reason!r} is not the last turn's {turns[-1].finish_reason!r}")
