"""Token-exact prompts: the engine samples each turn in exactly the token stream the trainer will train on.

Harnesses rebuild their history their own way (Gemini CLI drops thought parts, Pi and Qwen Code re-serialise
tool-call arguments compactly), so a prompt rendered from their messages holds *other* tokens than the ones the
model sampled. prefix_merging then trains those sampled ids in a context the model never saw. Here the gateway
keeps, per session, the chains that prefix_merging will form — each with the exact token stream the engine has
seen and sampled so far — and sends the engine

    chain stream (the tip call's prompt ids + its sampled ids) + the new prompt's tail after the end-of-turn
    that closes the previous assistant turn

as `input_ids`: the online form of the merge rule, so merge later rebuilds precisely those sequences.

Routing mirrors `reconstruct.prefix_merging`: the chain whose rendered tip (the harness's previous prompt,
rendered by the engine's template) is the longest prefix of the new rendered prompt; ties go to the most
recently extended chain (a kept retry); extending a chain retires its twins (samples the harness discarded).
Prefixes are compared as rendered *text* — every tip ends where the next prompt continues the conversation,
and the tail is tokenized alone, starting right after a special token.

A chain is extended only when the harness's copy of the previous answer *is* what was sampled, modulo exactly:
reasoning removed, tool-call arguments re-serialised (equal as parsed JSON), whitespace around blocks. Anything
else (an edited or injected assistant message, another tool call) opens a new chain, with the reason recorded.
Nothing is guessed. Pure logic: no I/O, no event loop; one lock per table, since calls run in worker threads.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from polar_mitm.conversation import Completion, Message, ToolCall
from polar_mitm.gateway.incremental_render import RenderedTip
from polar_mitm.reconstruct import compaction_label

# Why a call did not extend a chain (recorded as `splice_reason`).
NO_CHAIN = "no chain for this session yet"  # first call, or the gateway restarted / evicted the session
NO_PREFIX = "no prefix match"  # history rewritten (compaction, another agent), or a new thread
NO_EOT = "no end-of-turn after the chain tip"
RETRY = "same prompt as a chain tip (retry): re-sent that call's exact prompt"
ANSWER_DIFFERS = "the harness's previous assistant turn differs from what was sampled"
RENDERER_MISMATCH = "the gateway's rendering differs from the engine's: session falls back to messages mode"
SESSION_FALLBACK = "session in messages mode (renderer mismatch earlier)"
COMPACTION = (
    compaction_label.COMPACTION
)  # a main call's new chain after a compaction (merge counts it the same way)

MAX_CHAINS_PER_SESSION = 16


@dataclass(eq=False)  # chains are compared by identity
class Chain:
    """One thread of a session: what the engine saw and sampled at its tip call, and how to route to it."""

    tip_text: str  # the harness's tip prompt, rendered by the engine's template
    n_messages: int  # messages in the tip call
    # The engine's token stream at the tip: the ids it was given, then what it sampled. Kept as the list the
    # engine's answer was parsed into, so neither planning nor committing converts a whole prompt.
    stream: list[int]
    prompt_len: int  # stream[:prompt_len] is the tip call's prompt
    answer: Message  # the sampled answer as the engine parsed it
    closed: bool  # sampled ids end with the end-of-turn token
    turns: int  # sampled turns in engine_prompt + sampled
    stamp: int = 0  # last extension (routing tie-break)
    retired: bool = False
    # What tip_text was rendered from: the next call renders only the messages it adds (incremental_render.py).
    rendered: RenderedTip | None = None

    def size(self) -> int:
        return len(self.stream) + len(self.tip_text) // 2  # the text, and the messages it was rendered from


@dataclass
class Plan:
    """How to prompt the engine for one call, decided before the engine is asked."""

    session_id: str
    text: str  # the new rendered prompt
    n_messages: int
    input_ids: list[int] | None = None  # None: let the engine render the messages
    chain: Chain | None = None  # the chain this call extends (or retries)
    chain_stamp: int = 0  # the chain's stamp when planned (a concurrent extension forks instead)
    retry: bool = False
    # Earlier sampled turns carried verbatim; 0 = this call opens a new chain (merge starts a sequence there
    # too); None = no chain logic applied (the session is in messages mode).
    spliced_turns: int | None = 0
    reason: str | None = None  # why no splice (None: extended a chain)
    call_kind: str | None = (
        None  # the record's call_kind: who takes a compaction's label (reconstruct/compaction_label.py)
    )
    rendered: RenderedTip | None = None  # what `text` was rendered from (the chain it commits to keeps it)


@dataclass
class _Session:
    chains: list[Chain] = field(default_factory=list)
    fallback: bool = False  # the renderer disagreed with the engine: messages mode for good
    clock: int = 0
    compacted: bool = False  # a compaction's label is pending: the next main call opening a chain takes it


class TokenChains:
    """Per-session chains, bounded in memory (least recently used sessions are forgotten first)."""

    def __init__(self, eot_id: int, eot_text: str, *, max_tokens: int = 64 << 20) -> None:
        self.eot_id, self.eot_text = eot_id, eot_text
        self.max_tokens = max_tokens
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    # -- before the engine call --------------------------------------------------------------------------------

    def plan(
        self, session_id: str, text: str, messages: list[Message], encode, call_kind: str | None = None
    ) -> Plan:
        """Route a call to a chain and build its prompt ids (`encode` tokenizes the tail text).

        `call_kind` (main | side | compaction, gateway/call_kind.py) decides which new chain after a compaction
        is recorded as its consequence; None behaves as a main call.
        """
        plan = self._plan(session_id, text, messages, encode)
        plan.call_kind = call_kind
        if plan.input_ids is None or plan.chain is None:
            with self._lock:
                self._compaction_reason(plan)
        return plan

    def routable(self, session_id: str) -> bool:
        """Whether a call of this session may extend a chain (it has one, and is not in messages mode for good)."""
        with self._lock:
            session = self._sessions.get(session_id)
            return session is not None and bool(session.chains) and not session.fallback

    def tips(self, session_id: str) -> list[RenderedTip]:
        """What this session's chain tips were rendered from, most messages first (for incremental rendering)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.fallback:
                return []
            chains = sorted(session.chains, key=lambda c: c.n_messages, reverse=True)
            return [c.rendered for c in chains if c.rendered is not None]

    def unrouted_plan(self, session_id: str, n_messages: int, call_kind: str | None = None) -> Plan:
        """The plan of a call `routable` said no to, made without its rendering: a session's first call (its
        `text` is filled in by the renderer check, before `commit`) or one in messages mode for good."""
        plan = Plan(
            session_id=session_id, text="", n_messages=n_messages, reason=NO_CHAIN, call_kind=call_kind
        )
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                self._sessions.move_to_end(session_id)
                if session.fallback:
                    plan.reason, plan.spliced_turns = SESSION_FALLBACK, None
        return plan

    def _plan(self, session_id: str, text: str, messages: list[Message], encode) -> Plan:
        plan = Plan(session_id=session_id, text=text, n_messages=len(messages))
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                self._sessions.move_to_end(session_id)
            if session is None or not session.chains:
                plan.reason = NO_CHAIN
                return plan
            if session.fallback:
                plan.reason, plan.spliced_turns = SESSION_FALLBACK, None
                return plan
            chain = self._route(session, text)
            if chain is None:
                plan.reason = NO_PREFIX
                return plan
            plan.chain, plan.chain_stamp = chain, chain.stamp
            stream, prompt_len, closed, turns = chain.stream, chain.prompt_len, chain.closed, chain.turns
            tip_len, n_tip, answer = len(chain.tip_text), chain.n_messages, chain.answer
        if len(text) == tip_len:  # a retry: sample again in the tip call's own context
            plan.input_ids, plan.retry, plan.reason = stream[:prompt_len], True, RETRY
            plan.spliced_turns = turns - 1
            return plan
        eot_at = text.find(self.eot_text, tip_len)
        if eot_at < 0:
            plan.chain, plan.reason = None, NO_EOT
            return plan
        differs = answer_difference(messages, n_tip, answer)
        if differs is not None:
            plan.chain, plan.reason = None, f"{ANSWER_DIFFERS}: {differs}"
            return plan
        # Closed answer: the tail starts after its end-of-turn. Cut short (no end-of-turn sampled): the tail
        # starts *at* the end-of-turn, so the stream still closes that turn — the merge rule, exactly.
        tail = text[eot_at + len(self.eot_text) :] if closed else text[eot_at:]
        plan.input_ids = stream + encode(tail)  # a new list: the chain's stream is never changed in place
        plan.spliced_turns = turns
        return plan

    def _compaction_reason(self, plan: Plan) -> None:
        """Name a main call's new chain after a compaction, as merge does (retries are not new threads)."""
        session = self._sessions.get(plan.session_id)
        if session is not None and plan.spliced_turns == 0 and plan.reason not in (None, NO_CHAIN):
            plan.reason = compaction_label.new_chain_reason(session.compacted, plan.call_kind, plan.reason)

    def _route(self, session: _Session, text: str) -> Chain | None:
        best: Chain | None = None
        for chain in session.chains:
            if chain.retired or len(chain.tip_text) > len(text) or not text.startswith(chain.tip_text):
                continue
            if best is None or (len(chain.tip_text), chain.stamp) > (len(best.tip_text), best.stamp):
                best = chain
        return best

    # -- after the engine answered -----------------------------------------------------------------------------

    def commit(self, plan: Plan, completion: Completion) -> None:
        """Advance (or open) the chain with what the engine saw and sampled for this call."""
        stream = [*completion.prompt_ids, *completion.completion_ids]
        sampled = completion.completion_ids
        answer = Message(
            role="assistant",
            content=completion.content,
            reasoning=completion.reasoning,
            tool_calls=list(completion.tool_calls),
        )
        closed = len(sampled) > 0 and sampled[-1] == self.eot_id
        with self._lock:
            session = self._sessions.get(plan.session_id)
            if session is None:
                session = self._sessions[plan.session_id] = _Session()
            if session.fallback:
                return
            session.clock += 1
            chain = plan.chain
            extend = (
                chain is not None
                and not plan.retry
                and chain.stamp == plan.chain_stamp
                and chain in session.chains
            )
            turns = (plan.spliced_turns or 0) + 1
            if extend:
                assert chain is not None
                self._size -= chain.size()
                chain.tip_text, chain.n_messages = plan.text, plan.n_messages
                chain.stream, chain.prompt_len = stream, len(completion.prompt_ids)
                chain.answer, chain.closed = answer, closed
                chain.turns, chain.stamp = turns, session.clock
                chain.rendered = plan.rendered
                self._size += chain.size()
            else:  # a new thread, a retry (a fork of its tip), or a chain extended meanwhile by another call
                chain = Chain(
                    tip_text=plan.text,
                    n_messages=plan.n_messages,
                    stream=stream,
                    prompt_len=len(completion.prompt_ids),
                    answer=answer,
                    closed=closed,
                    turns=turns,
                    stamp=session.clock,
                    rendered=plan.rendered,
                )
                session.chains.append(chain)
                self._size += chain.size()
            for other in session.chains:  # the harness went on from this sample: its twins were discarded
                if other is not chain and other.tip_text == chain.tip_text and not plan.retry:
                    other.retired = True
            session.compacted = compaction_label.pending_after(
                session.compacted, plan.call_kind, opened=not extend and not plan.retry
            )
            self._trim(session)
            self._evict()

    def fall_back(self, session_id: str) -> None:
        """Messages mode for the rest of this session (the renderer disagreed with the engine)."""
        with self._lock:
            session = self._sessions.setdefault(session_id, _Session())
            session.fallback = True
            self._size -= sum(c.size() for c in session.chains)
            session.chains.clear()

    def _trim(self, session: _Session) -> None:
        live = [c for c in session.chains if not c.retired]
        keep = sorted(live, key=lambda c: c.stamp)[-MAX_CHAINS_PER_SESSION:]
        dropped = [c for c in session.chains if c not in keep]
        self._size -= sum(c.size() for c in dropped)
        session.chains = keep

    def _evict(self) -> None:
        while self._size > self.max_tokens and len(self._sessions) > 1:
            _, session = self._sessions.popitem(last=False)
            self._size -= sum(c.size() for c in session.chains)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "sessions": len(self._sessions),
                "chains": sum(len(s.chains) for s in self._sessions.values()),
                "tokens": self._size,
            }


# -- does the harness's copy of the previous answer correspond to what was sampled? ---------------------------


def answer_difference(messages: list[Message], index: int, sampled: Message) -> str | None:
    """None when messages[index] is the sampled answer modulo the allowed rewrites; else what differs."""
    if index >= len(messages) or messages[index].role != "assistant":
        return f"message {index} is not the assistant turn"
    if index + 1 < len(messages) and messages[index + 1].role == "assistant":
        return "the assistant turn is split over several messages"
    sent = messages[index]
    if _squash(sent.content) != _squash(sampled.content):
        return "text content"
    if sent.reasoning and _squash(sent.reasoning) != _squash(sampled.reasoning):
        return "reasoning"
    if len(sent.tool_calls) != len(sampled.tool_calls):
        return f"{len(sent.tool_calls)} tool calls where {len(sampled.tool_calls)} were sampled"
    for mine, theirs in zip(sent.tool_calls, sampled.tool_calls, strict=True):
        if mine.name != theirs.name:
            return f"tool call {mine.name!r} where {theirs.name!r} was sampled"
        if _arguments(mine) != _arguments(theirs):
            return f"arguments of tool call {mine.name!r}"
    return None


def _squash(text: str | None) -> str:
    """Whitespace around blocks does not count (harnesses trim text blocks)."""
    return (text or "").strip()


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return ("unparsed", call.arguments.strip())
