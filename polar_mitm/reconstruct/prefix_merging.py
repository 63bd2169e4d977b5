"""prefix_merging: join a session's model calls into long sequences, token-faithfully, dropping nothing.

Within a session, in `seq` order, each call goes to the open chain whose *last prompt* ids are a prefix of its
prompt ids (longest match; on a tie, the most recently extended chain — so a retried sample replaces the earlier
one, and interleaved subagents stay in separate chains). Once a call extends one of several chains that share a
tip, the others are closed: the harness kept one sample and discarded theirs. A chain's sequence is

    first prompt (mask 0) + its sampled ids (mask 1)
    + for each next call: its prompt after the end-of-turn token closing the previous assistant body (mask 0)
      + its sampled ids (mask 1) ...

Prompts are compared with prompts only, never with re-encoded sampled text: the engine renders the previous
answer into the next prompt with its own tokenisation (which may differ from the sampled ids), so the sampled
ids are kept as they were sampled and only the prompt's tail after that rendered answer is added as context.
When the previous answer was cut short (no end-of-turn at the end of its sampled ids), the prompt's end-of-turn
token is kept in the context. A call that cannot be spliced onto any chain starts a new one; Polar's original
stopped the chain and dropped the rest of the session. A call whose record says the gateway opened a new chain
there (tokens mode, `spliced_turns == 0`: the harness's history did not continue any sampled stream) starts a new
one too, so merge and gateway agree on every sequence. After a compaction call (record `call_kind ==
"compaction"`: the harness summarised its history to go on from the summary), the next *main* call that starts a
sequence (not a retry) counts under the reason "compaction", in merge and in the gateway's `splice_reason` alike;
side calls and further compaction calls in between keep their own reasons (one rule:
`reconstruct/compaction_label.py`).

Routing cost: one vectorised pass over each prompt (prefix hashes), an O(1) hash check per open chain (no
token comparison except with the chosen chain), and a search for the end-of-turn token in the new tail only —
linear in total tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from polar_mitm.reconstruct.compaction_label import COMPACTION, new_chain_reason, pending_after
from polar_mitm.reconstruct.turns import BuildResult, TurnRecord, sampling_columns, version_columns
from polar_mitm.storage.merged import MergedSequence

BUILDER_NAME = "prefix_merging"

# Why a call started a new sequence although its session already had one.
BREAK_NO_PREFIX = "no prefix match"  # history rewritten (compaction, stripped thinking), or another agent
BREAK_SAME_PROMPT = "same prompt as a chain tip"  # a retry or resample of a prompt already answered
BREAK_NO_EOT = "no end-of-turn after tip"  # the prompt grew, but not by a closed assistant turn
BREAK_GATEWAY = "gateway opened a new chain"  # tokens mode: the harness's history did not continue a stream
BREAK_COMPACTION = COMPACTION  # the history was replaced by a compaction summary (rule: compaction_label)

# End-of-turn tokens of common chat templates, by token text (ChatML first: the gateway's engines use it).
KNOWN_EOT_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


class PrefixHasher:
    """Hashes of every prefix of a token array in one vectorised pass.

    h[i] = Σ_{j ≤ i} ids[j] · w[j]  (mod 2^64) with fixed pseudo-random odd weights w. Equal prefixes hash
    equally; unequal ones collide with negligible probability — and the router verifies its pick anyway.
    The weights are generated in fixed chunks so that growing them never changes the ones already used.
    """

    CHUNK = 1 << 16

    def __init__(self, seed: int = 0x9E3779B9) -> None:
        self._seed = seed
        self._weights = np.zeros(0, dtype=np.uint64)

    def _ensure(self, n: int) -> None:
        chunks = [self._weights]
        have = len(self._weights)
        while have < n:
            bits = np.random.PCG64([self._seed, have // self.CHUNK]).random_raw(self.CHUNK)
            chunks.append(np.asarray(bits, dtype=np.uint64) | np.uint64(1))
            have += self.CHUNK
        if len(chunks) > 1:
            self._weights = np.concatenate(chunks)

    def prefix_hashes(self, ids: np.ndarray) -> np.ndarray:
        """uint64 array h with h[i] the hash of ids[:i + 1]."""
        self._ensure(len(ids))
        return np.cumsum(ids.astype(np.uint64) * self._weights[: len(ids)], dtype=np.uint64)


_HASHER = PrefixHasher()


@dataclass
class _Chain:
    """A sequence being built: its turns, the pieces of its token stream, and its routing key (the tip)."""

    turns: list[TurnRecord]
    contexts: list[np.ndarray]  # what precedes each turn's sampled ids: the first prompt, then prompt tails
    tip: np.ndarray  # the last turn's prompt ids: what the next turn's prompt must start with
    tip_hash: int
    tip_closed: bool  # the last turn's sampled ids end with the end-of-turn token
    last_extended: int = 0


_RETIRED = np.iinfo(np.int64).max  # a tip length no prompt reaches: the chain is never routed to again


class _ChainTable:
    """The session's open chains, routed by (tip length, tip hash) — one slot per chain, vectorised lookups."""

    def __init__(self) -> None:
        self.chains: list[_Chain] = []
        self._lengths = np.zeros(8, dtype=np.int64)
        self._hashes = np.zeros(8, dtype=np.uint64)
        self._stamps = np.zeros(8, dtype=np.int64)

    def add(self, chain: _Chain) -> None:
        slot = len(self.chains)
        if slot == len(self._lengths):
            self._lengths, self._hashes, self._stamps = (
                np.concatenate([a, np.zeros_like(a)]) for a in (self._lengths, self._hashes, self._stamps)
            )
        self.chains.append(chain)
        self.update(slot)

    def update(self, slot: int) -> None:
        chain = self.chains[slot]
        self._lengths[slot] = len(chain.tip)
        self._hashes[slot] = chain.tip_hash
        self._stamps[slot] = chain.last_extended

    def retire_twins(self, slot: int) -> None:
        """Stop routing to chains that share `slot`'s tip: the harness continued from `slot`'s sample, so theirs
        were thrown away (retries) and must not catch a later call whose history was rewritten."""
        chain, k = self.chains[slot], len(self.chains)
        twins = np.flatnonzero((self._lengths[:k] == len(chain.tip)) & (self._hashes[:k] == chain.tip_hash))
        for twin in twins:
            if twin != slot and np.array_equal(self.chains[twin].tip, chain.tip):
                self._lengths[twin] = _RETIRED

    def longest_prefix(self, prompt: np.ndarray, hashes: np.ndarray) -> int | None:
        """Slot of the chain whose tip is the longest prefix of `prompt` (ties: most recently extended)."""
        k = len(self.chains)
        if k == 0:
            return None
        lengths, stamps = self._lengths[:k], self._stamps[:k]
        fits = lengths <= len(prompt)
        ends = np.where(fits, lengths, 1) - 1
        candidates = np.flatnonzero(fits & (hashes[ends] == self._hashes[:k]))
        # Best first: longest tip, then latest extension.
        for slot in candidates[np.lexsort((stamps[candidates], lengths[candidates]))[::-1]]:
            tip = self.chains[slot].tip
            if np.array_equal(prompt[: len(tip)], tip):  # rules out a hash collision
                return int(slot)
        return None


def splice_point(prompt: np.ndarray, tip_len: int, tip_closed: bool, eot_token_id: int) -> int | None:
    """Where the context of a turn starts in its prompt, given the chain tip it extends (None: cannot splice).

    The previous answer is rendered right after the tip and closed by the first end-of-turn token at or after
    `tip_len`; the context starts after it — or at it when the previous sampled ids lacked their own
    end-of-turn (a truncated turn), so that the sequence still closes that turn.
    """
    tail = prompt[tip_len:]
    hits = tail == eot_token_id
    first = int(hits.argmax()) if len(tail) else 0
    if len(tail) == 0 or not hits[first]:
        return None
    return tip_len + first + (1 if tip_closed else 0)


def _ends_turn(sampled: np.ndarray, eot_token_id: int) -> bool:
    return len(sampled) > 0 and int(sampled[-1]) == eot_token_id


def build_prefix_merging(turns: Sequence[TurnRecord], *, eot_token_id: int | None) -> BuildResult:
    """Merge one session's trainable turns (already in session order, see `turns.prepare_session`)."""
    if eot_token_id is None:
        raise ValueError("prefix_merging needs the end-of-turn token id (see --eot-token / --tokenizer)")
    table = _ChainTable()
    breaks: Counter[str] = Counter()
    compacted = False  # a compaction's label is pending: the next main call opening a sequence takes it
    for step, turn in enumerate(turns, start=1):
        prompt, sampled = turn.prompt_ids, turn.completion_ids
        assert prompt is not None and sampled is not None
        hashes = _HASHER.prefix_hashes(prompt)
        slot = None if turn.new_chain else table.longest_prefix(prompt, hashes)
        start = None
        reason = None
        if turn.new_chain and table.chains:
            reason = BREAK_GATEWAY
        elif slot is not None:
            chain = table.chains[slot]
            start = splice_point(prompt, len(chain.tip), chain.tip_closed, eot_token_id)
            if start is None:
                reason = BREAK_SAME_PROMPT if len(prompt) == len(chain.tip) else BREAK_NO_EOT
        elif table.chains:
            reason = BREAK_NO_PREFIX
        opened = reason is not None and reason != BREAK_SAME_PROMPT  # a new thread (a retry forks its tip)
        if reason is not None:
            breaks[new_chain_reason(compacted, turn.call_kind, reason) if opened else reason] += 1
        compacted = pending_after(compacted, turn.call_kind, opened=opened)
        if slot is not None and start is not None:
            table.retire_twins(slot)
            chain = table.chains[slot]
            chain.turns.append(turn)
            chain.contexts.append(prompt[start:])
            chain.tip, chain.tip_hash = prompt, int(hashes[-1])
            chain.tip_closed, chain.last_extended = _ends_turn(sampled, eot_token_id), step
            table.update(slot)
        else:
            table.add(
                _Chain(
                    turns=[turn],
                    contexts=[prompt],
                    tip=prompt,
                    tip_hash=int(hashes[-1]),
                    tip_closed=_ends_turn(sampled, eot_token_id),
                    last_extended=step,
                )
            )
    return BuildResult(
        sequences=[assemble(chain.turns, chain.contexts) for chain in table.chains], breaks=breaks
    )


def assemble(
    turns: Sequence[TurnRecord], contexts: Sequence[np.ndarray], builder: str = BUILDER_NAME
) -> MergedSequence:
    """context₀ + sampled₀ + context₁ + sampled₁ + … as one sequence (mask 1 and logprobs on sampled ids only).

    `extra["sampled_starts"]` keeps where each turn's sampled ids begin (not persisted).
    """
    sizes = [(len(c), len(t.completion_ids)) for c, t in zip(contexts, turns, strict=True)]
    total = sum(a + b for a, b in sizes)
    input_ids = np.empty(total, dtype=np.int32)
    loss_mask = np.zeros(total, dtype=np.int8)
    logprobs = np.zeros(total, dtype=np.float32)
    starts = []
    pos = 0
    for (n_context, n_sampled), context, turn in zip(sizes, contexts, turns, strict=True):
        input_ids[pos : pos + n_context] = context
        pos += n_context
        starts.append(pos)
        input_ids[pos : pos + n_sampled] = turn.completion_ids
        loss_mask[pos : pos + n_sampled] = 1
        logprobs[pos : pos + n_sampled] = turn.completion_logprobs
        pos += n_sampled
    first = turns[0]
    return MergedSequence(
        sequence_id=f"{first.session_id}:{first.request_id}",
        session_id=first.session_id,
        task_id=next((t.task_id for t in turns if t.task_id is not None), None),
        input_ids=input_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        prompt_len=sizes[0][0],
        request_ids=[t.request_id for t in turns],
        n_turns=len(turns),
        builder=builder,
        finish_reason=turns[-1].finish_reason,
        turn_starts=starts,
        **sampling_columns(turns),
        **version_columns(turns, starts),
        extra={"sampled_starts": starts},
    )


# -- Polar's original routing, for comparison ------------------------------------------------------------------


@dataclass
class PolarRouting:
    """What Polar's prefix_merging keeps of a session: one chain, cut at the first break; the rest dropped."""

    chain: list[str]  # request ids merged into the single sequence
    dropped: list[str]  # request ids after the first break


def polar_routing(turns: Sequence[TurnRecord], *, eot_token_id: int) -> PolarRouting:
    """Polar's routing on the same trainable turns (a reference for benchmarks; never used to train)."""
    if not turns:
        return PolarRouting(chain=[], dropped=[])
    tip, closed = turns[0].prompt_ids, _ends_turn(turns[0].completion_ids, eot_token_id)
    chain = [turns[0].request_id]
    for i, turn in enumerate(turns[1:], start=1):
        prompt = turn.prompt_ids
        extends = len(prompt) >= len(tip) and np.array_equal(prompt[: len(tip)], tip)
        if not extends or splice_point(prompt, len(tip), closed, eot_token_id) is None:
            return PolarRouting(chain=chain, dropped=[t.request_id for t in turns[i:]])
        chain.append(turn.request_id)
        tip, closed = prompt, _ends_turn(turn.completion_ids, eot_token_id)
    return PolarRouting(chain=chain, dropped=[])


# -- end-of-turn detection --------------------------------------------------------------------------------------


def eot_from_tokenizer(tokenizer) -> int:
    """The end-of-turn id of a Hugging Face tokenizer: a known chat end-of-turn token, else its EOS."""
    vocab = tokenizer.get_vocab()
    for text in KNOWN_EOT_TOKENS:
        if text in vocab:
            return int(vocab[text])
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no end-of-turn or EOS token; pass --eot-token")
    return int(tokenizer.eos_token_id)


def eot_from_last_tokens(last_ids: Iterable[tuple[str, int]]) -> int | None:
    """The most common last sampled id among calls that stopped on their own (ties: the smallest id).

    `last_ids` holds (finish_reason, last sampled id) per call; truncated and failed calls are ignored.
    """
    counts: Counter[int] = Counter(token for reason, token in last_ids if reason in ("stop", "tool_calls"))
    if not counts:
        return None
    return min(counts, key=lambda token: (-counts[token], token))
