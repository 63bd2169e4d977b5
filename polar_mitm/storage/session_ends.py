"""How a session ended — one vocabulary for the rewards file, the merged sequences, the service's traces and the
loop's figures — and the rules that say what training does with each end.

Why: a session ends in many ways, and a session that ends badly must not teach the model the wrong thing (peers
lose rollouts to unparsed tool calls, silent truncation and context overflow). Before this module each place had
its own words — the runner's `status` (ok | failed | timeout | crashed | init_failed | error | cut), the last call's
engine finish reason on merged rows and traces — and nothing decided what training did with which.

The ends, strongest first (`PRECEDENCE`: where several apply, the first one is the session's end):

    cut > cancelled > harness_timeout > engine_error > context_overflow > harness_crash > length
        > unparsed_tool_call > completed

What we did to the session comes first (stopped it: the straggler cut, a cancelled rollout, the harness's timeout),
then what the engine said to its last call (an error, the context full): a harness that exits non-zero *because*
its last call failed ended by that failure, not by a crash of its own. Then the harness's own crash, then what the
model did on its last call: a truncated answer (`length`) outranks the broken tool call the truncation left (a
`<tool_call>` cut before its end is the budget's doing, not a parse failure).

A session's end (`session_end`) is the runner's part (`status_end`: what happened to the process) combined with its
last call's end (`calls_end`: the last main call — side calls such as titles and aborted calls, where the harness
hung up, say nothing of how the agent's conversation ended). A harness is graded only when it exits 0 (the runner's
rule), so an exit != 0 is always `harness_crash` unless an end above it applies. A service trace's end is its
session's end (`service/traces.py`).

The rules (`EndRule`, one per end in `RULED_ENDS`: not `completed`, always kept, nor `cut` and `cancelled`, which
have no reward and are never trained on): `keep` trains the session as recorded with its reward; `zero` trains it with the failure reward
instead; `mask` leaves it out (its sequences excluded and counted; its group's advantages use the other sessions).
The loop declares one option per rule (`loop/config.py`) and merge applies them where rewards meet sequences
(`reconstruct/merge.py`).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

log = logging.getLogger(__name__)


class SessionEnd(StrEnum):
    """How a session (or a trace) ended; declared strongest first (`PRECEDENCE`)."""

    CUT = "cut"
    CANCELLED = "cancelled"
    HARNESS_TIMEOUT = "harness_timeout"
    ENGINE_ERROR = "engine_error"
    CONTEXT_OVERFLOW = "context_overflow"
    HARNESS_CRASH = "harness_crash"
    LENGTH = "length"
    UNPARSED_TOOL_CALL = "unparsed_tool_call"
    COMPLETED = "completed"


MEANINGS: dict[SessionEnd, str] = {
    SessionEnd.CUT: "stopped by the straggler cut (--keep K: K sessions of its group were done); no reward",
    SessionEnd.CANCELLED: "stopped because its rollout was interrupted (Ctrl-C, SIGTERM); no reward",
    SessionEnd.HARNESS_TIMEOUT: "the harness ran past the task's run timeout and was killed",
    SessionEnd.ENGINE_ERROR: "its last model call failed: the engine (or the gateway) answered an error",
    SessionEnd.CONTEXT_OVERFLOW: "its last model call's prompt was longer than the engine's context",
    SessionEnd.HARNESS_CRASH: "it ended without a grade: the harness exited non-zero, its setup failed, or the "
    "runner failed around it",
    SessionEnd.LENGTH: "its last answer hit the completion budget (max_tokens)",
    SessionEnd.UNPARSED_TOOL_CALL: "its last answer held a tool call the parser could not read (the harness got it "
    "as text)",
    SessionEnd.COMPLETED: "the agent ended its conversation on its own and was graded",
}
PRECEDENCE: tuple[SessionEnd, ...] = tuple(SessionEnd)
END_VALUES: tuple[str, ...] = tuple(str(end) for end in PRECEDENCE)  # as the files hold them
_RANK = {end: rank for rank, end in enumerate(PRECEDENCE)}


def combine(*ends: SessionEnd | str | None) -> SessionEnd | None:
    """The strongest of `ends` (None where none is given)."""
    given = [SessionEnd(end) for end in ends if end is not None]
    return min(given, key=_RANK.__getitem__) if given else None


# -- the runner's part -------------------------------------------------------------------------------------------

# The runner's statuses (rollout/runner.py) whose session ended on the runner's side; `ok` and `failed` were graded,
# so their calls say how they ended.
STATUS_ENDS: dict[str, SessionEnd] = {
    "cut": SessionEnd.CUT,
    "cancelled": SessionEnd.CANCELLED,
    "timeout": SessionEnd.HARNESS_TIMEOUT,
    "crashed": SessionEnd.HARNESS_CRASH,
    "init_failed": SessionEnd.HARNESS_CRASH,
    "error": SessionEnd.HARNESS_CRASH,
}


def status_end(status: str | None) -> SessionEnd | None:
    """The end a runner status says on its own (None for a graded session: `ok`, `failed`). From the status alone a
    `timeout` reads as the harness's: the runner itself tells an evaluation that timed out apart (SessionRun.end)."""
    return STATUS_ENDS.get(status or "")


# -- the calls' part ---------------------------------------------------------------------------------------------


class CallFacts(Protocol):
    """What a call's record says of how it ended (a records row, or reconstruct's TurnRecord)."""

    seq: int
    started_at: int  # epoch microseconds: orders calls that share a seq
    finish_reason: str | None
    error: str | None
    call_kind: str | None
    unparsed_tool_call: bool


@dataclass(frozen=True)
class RecordedCall:
    """A record's end-deciding columns (`END_COLUMNS`), for readers that do not build TurnRecords."""

    seq: int
    started_at: int  # epoch microseconds
    finish_reason: str | None
    error: str | None
    call_kind: str | None = None
    unparsed_tool_call: bool = False


# A recorded error is "KIND: message" (the gateway's GatewayError kinds, codecs/base.py).
OVERFLOW_ERROR_KIND = "context_length"
ABORT_FINISH = "abort"  # the harness hung up before the answer (finish_reason abort, status 499)


def call_end(finish_reason: str | None, error: str | None, unparsed: bool = False) -> SessionEnd | None:
    """How one call ended; None for an aborted call (the harness hung up: nothing of the model's answer)."""
    if finish_reason == ABORT_FINISH:
        return None
    if error:
        kind = error.split(":", 1)[0].strip()
        return SessionEnd.CONTEXT_OVERFLOW if kind == OVERFLOW_ERROR_KIND else SessionEnd.ENGINE_ERROR
    if finish_reason == "error":
        return SessionEnd.ENGINE_ERROR
    if finish_reason == "length":
        return SessionEnd.LENGTH
    return SessionEnd.UNPARSED_TOOL_CALL if unparsed else SessionEnd.COMPLETED


def last_call(calls: Iterable[CallFacts]) -> CallFacts | None:
    """The call a session's conversation ended on: the last (by seq, then start) that was not aborted, among its
    main calls when it has any (a harness's side calls — titles, classifiers — may come after the agent's last)."""
    answered = [c for c in calls if c.finish_reason != ABORT_FINISH]
    main = [c for c in answered if c.call_kind != "side"] or answered
    return max(main, key=lambda c: (c.seq, c.started_at), default=None)


def calls_end(calls: Iterable[CallFacts]) -> SessionEnd:
    """How a session's calls ended: its last call's end (`completed` without a call)."""
    last = last_call(calls)
    if last is None:
        return SessionEnd.COMPLETED
    return call_end(last.finish_reason, last.error, last.unparsed_tool_call) or SessionEnd.COMPLETED


def session_end(runner: SessionEnd | str | None, calls: Iterable[CallFacts]) -> SessionEnd:
    """A session's end: the runner's part (SessionRun.end, or `status_end(status)`) and its calls', by precedence."""
    return combine(runner, calls_end(calls)) or SessionEnd.COMPLETED


# -- an unparsed tool call, from the answer the harness got ------------------------------------------------------

# What opens a tool call in the models' own notation (Hermes/Qwen `<tool_call>`, Qwen3-Coder's XML inside it). A
# parsed call leaves the answer's text as a structured call; one the parser could not read stays text — the
# engine's parser keeps it (engine/parsers.py) and the gateway shows a call the harness cannot run as text
# (conversation.harness_safe) — so the marker left in the answer is a call that was not parsed.
TOOL_CALL_OPENERS = ("<tool_call>",)
# Parts of an answer that echo the request (the Responses API returns its instructions and tools): not the model's.
ECHOED_KEYS = frozenset({"instructions", "tools", "metadata"})


def unparsed_tool_call(response_json: str | None) -> bool:
    """Whether a recorded answer (provider-native JSON) holds a tool call as text, i.e. one that was not parsed."""
    if not response_json or not any(opener in response_json for opener in TOOL_CALL_OPENERS):
        return False
    try:
        answer = json.loads(response_json)
    except ValueError:
        return True  # not JSON: the text is the answer
    return any(opener in text for text in _answer_strings(answer) for opener in TOOL_CALL_OPENERS)


def _answer_strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in ECHOED_KEYS:
                yield from _answer_strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _answer_strings(item)


def unparsed_tool_calls(responses: pa.Array | pa.ChunkedArray) -> list[bool]:
    """`unparsed_tool_call` of each row of a `response_json` column (the few holding a marker parsed, no other)."""
    if len(responses) == 0:
        return []
    marked = pc.fill_null(pc.match_substring(responses, TOOL_CALL_OPENERS[0]), False)
    for opener in TOOL_CALL_OPENERS[1:]:
        marked = pc.or_(marked, pc.fill_null(pc.match_substring(responses, opener), False))
    flags = [False] * len(responses)
    for i in pc.indices_nonzero(marked).to_pylist():
        flags[i] = unparsed_tool_call(responses[i].as_py())
    return flags


# -- the records' part, read ---------------------------------------------------------------------------------------

# The record columns that decide a call's end.
END_COLUMNS = ("session_id", "seq", "started_at", "finish_reason", "error", "call_kind", "response_json")


def recorded_calls(table: pa.Table) -> dict[str, list[RecordedCall]]:
    """Each session's calls in a records table (END_COLUMNS; the optional ones may be missing)."""
    n, names = table.num_rows, set(table.column_names)

    def column(name: str) -> list[Any]:
        return table.column(name).to_pylist() if name in names else [None] * n

    unparsed = unparsed_tool_calls(table.column("response_json")) if "response_json" in names else [False] * n
    sessions, seqs, started = column("session_id"), column("seq"), _micros(table, "started_at")
    finish, errors, kinds = column("finish_reason"), column("error"), column("call_kind")
    calls: dict[str, list[RecordedCall]] = defaultdict(list)
    for i in range(n):
        calls[sessions[i]].append(
            RecordedCall(seqs[i] or 0, started[i], finish[i], errors[i], kinds[i], unparsed[i])
        )
    return dict(calls)


def _micros(table: pa.Table, name: str) -> list[int]:
    """A timestamp column as epoch microseconds (0 where missing), so calls order whatever their unit."""
    if name not in table.column_names:
        return [0] * table.num_rows
    column = table.column(name)
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.timestamp("us", tz=column.type.tz)).cast(pa.int64())
    return [0 if v is None else int(v) for v in column.to_pylist()]


def read_recorded_calls(flows: str | Path) -> dict[str, list[RecordedCall]]:
    """Each session's calls in the records under `flows` (shards and live journals; unreadable parts skipped, as
    every records reader does); empty when there is no such folder."""
    from polar_mitm.storage.location import StorageError
    from polar_mitm.storage.records import list_sources

    if not Path(flows).exists():
        return {}
    found = list_sources([str(flows)])
    for problem in found.problems:
        log.warning("session ends: %s", problem)
    calls: dict[str, list[RecordedCall]] = defaultdict(list)
    for source in found.sources:
        try:
            table = source.read([c for c in END_COLUMNS if c in source.columns])
        except StorageError as exc:  # e.g. a corrupt data page behind an intact footer
            log.warning("session ends: %s (skipped)", exc)
            continue
        for session, mine in recorded_calls(table).items():
            calls[session].extend(mine)
    return dict(calls)


# -- the rules -----------------------------------------------------------------------------------------------------


class EndRule(StrEnum):
    """What training does with a rewarded session that ended a given way."""

    keep = "keep"  # trained as recorded, with its reward
    mask = "mask"  # no part in training: its sequences excluded (counted); its group uses the others
    zero = "zero"  # trained with the failure reward instead of its own


# The ends a rule applies to: `completed` is always kept; `cut` and `cancelled` sessions have no reward.
RULED_ENDS: tuple[SessionEnd, ...] = (
    SessionEnd.LENGTH,
    SessionEnd.UNPARSED_TOOL_CALL,
    SessionEnd.CONTEXT_OVERFLOW,
    SessionEnd.HARNESS_TIMEOUT,
    SessionEnd.HARNESS_CRASH,
    SessionEnd.ENGINE_ERROR,
)


@dataclass(frozen=True)
class EndRules:
    """A rule per end (ends not named are kept) and the reward `zero` gives."""

    rules: Mapping[SessionEnd, EndRule] = field(default_factory=dict)
    failure_reward: float = 0.0

    def rule(self, end: SessionEnd | str | None) -> EndRule:
        return EndRule.keep if end is None else EndRule(self.rules.get(SessionEnd(end), EndRule.keep))

    def reward(self, end: SessionEnd | str | None, reward: float) -> float | None:
        """The reward a session of `end` trains with (None: masked, no part in training)."""
        rule = self.rule(end)
        if rule is EndRule.mask:
            return None
        return self.failure_reward if rule is EndRule.zero else reward


def rule_key(end: SessionEnd | str, rule: EndRule | str) -> str:
    """How a rule applied to an end is counted (loop.json's `end_rules`, merge's summary): `length:mask`."""
    return f"{SessionEnd(end)}:{EndRule(rule)}"


def end_counts(ends: Sequence[SessionEnd | str | None]) -> dict[str, int]:
    """Sessions per end, in precedence order (`unknown` for a session whose end was never decided)."""
    counts: dict[str, int] = {}
    for end in [*PRECEDENCE, None]:
        n = sum(1 for e in ends if (e if e is None else SessionEnd(e)) == end)
        if n:
            counts["unknown" if end is None else str(end)] = n
    return counts


def ends_line(session_ends: Mapping[str, int], end_rules: Mapping[str, int] | None = None) -> str:
    """The sessions that did not complete, by end, with the rules that acted on them (the loop's table, the report):
    `2 length · 2 unparsed_tool_call (2 zero)`; `all completed`, or `—` where nothing was counted."""
    applied: dict[str, list[str]] = defaultdict(list)
    for key, n in (end_rules or {}).items():
        end, _, rule = key.partition(":")
        if rule != EndRule.keep:
            applied[end].append(f"{n} {rule}")
    parts = [
        f"{n} {end}" + (f" ({', '.join(applied[end])})" if applied.get(end) else "")
        for end, n in session_ends.items()
        if end != SessionEnd.COMPLETED
    ]
    return " · ".join(parts) or ("all completed" if session_ends else "—")
