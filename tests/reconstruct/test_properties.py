"""prefix_merging and per_request on hypothesis-generated sessions of a token-level ChatML model.

The simulator renders prompts the way a ChatML template does (`<|im_start|>role\\n … <|im_end|>\\n`, then
`<|im_start|>assistant\\n`) and knows, by construction, which calls belong together and where each rendered
assistant body ends in the next prompt. So the expected sequences below come from the simulator's bookkeeping,
not from the code under test. Sessions mix: interleaved subagents, compaction, cleared tool results, retries, error and
abort records, truncated (length) turns, thinking stripped from history, re-tokenisation drift in the echoed answer, duplicate
records and out-of-order arrival.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_mitm.reconstruct import prefix_merging
from polar_mitm.reconstruct.invariants import check_invariants
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.reconstruct.prefix_merging import (
    BREAK_NO_PREFIX,
    BREAK_SAME_PROMPT,
    build_prefix_merging,
    polar_routing,
)
from polar_mitm.reconstruct.turns import prepare_session, turns_from_table
from polar_mitm.storage.records import RECORD_SCHEMA

IM_START, EOT, NL = 151644, 151645, 198
SYSTEM, USER, ASSISTANT = 8948, 872, 77091
THINK, END_THINK = 151667, 151668
GEN = [IM_START, ASSISTANT, NL]
WORDS = list(range(1000, 1008))  # a small alphabet, so that the drift rules below fire often
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def retokenize(body: list[int]) -> list[int]:
    """The template's re-encoding of sampled text: merges 1001 1002 → 1500 and splits 1003 → 1600 1601."""
    out: list[int] = []
    i = 0
    while i < len(body):
        if body[i] == 1001 and i + 1 < len(body) and body[i + 1] == 1002:
            out.append(1500)
            i += 2
            continue
        out.extend([1600, 1601] if body[i] == 1003 else [body[i]])
        i += 1
    return out


def block(role: int, content: list[int]) -> list[int]:
    return [IM_START, role, NL, *content, EOT, NL]


@dataclass
class ExpectedChain:
    request_ids: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Agent:
    system: list[int]
    history: list[int]
    chain: ExpectedChain | None = None
    close: int = 0  # index, in every later prompt, of the <|im_end|> closing the last rendered answer
    closed: bool = True  # the last sampled ids ended with <|im_end|>
    kept_calls: int = 0  # answers in the history since it was last reset (compaction)
    first_tool: tuple[int, int] = (0, 0)  # (start, length) of the first tool result in the history

    def state(self) -> tuple:
        return self.history, self.close, self.closed, self.kept_calls, self.first_tool

    def restore(self, state: tuple) -> None:
        self.history, self.close, self.closed, self.kept_calls, self.first_tool = state


@dataclass
class Simulated:
    rows: list[dict]
    chains: dict[str, list[ExpectedChain]]  # by session, in first-call order
    retries: int = 0
    compactions: int = 0
    rewrites: int = 0
    drifted: int = 0


class SessionSimulator:
    def __init__(self, draw, session_id: str, task_id: str | None) -> None:
        self.draw, self.session_id, self.task_id = draw, session_id, task_id
        self.rows: list[dict] = []
        self.chains: list[ExpectedChain] = []
        self.seq = 0
        self.retries = self.compactions = self.rewrites = self.drifted = 0

    def words(self, lo: int, hi: int) -> list[int]:
        return self.draw(st.lists(st.sampled_from(WORDS), min_size=lo, max_size=hi))

    def record(self, prompt: list[int], sampled: list[int] | None, finish: str) -> dict:
        logprobs = (
            None if sampled is None else [-(0.125 * (i % 7) + 0.01 * self.seq) for i in range(len(sampled))]
        )
        row = dict(
            schema_version=1,
            request_id=f"{self.session_id}-r{self.seq:03d}",
            session_id=self.session_id,
            task_id=self.task_id,
            seq=self.seq,
            started_at=T0 + timedelta(milliseconds=self.seq),
            finished_at=T0 + timedelta(milliseconds=self.seq + 1),
            provider="openai_chat",
            path="/v1/chat/completions",
            stream=False,
            prompt_ids=list(prompt),
            completion_ids=sampled,
            completion_logprobs=logprobs,
            finish_reason=finish,
            weight_version=self.draw(st.sampled_from(["0", "1", "2", "10"])),
            error="engine_error: boom" if finish == "error" else None,
        )
        self.seq += 1
        self.rows.append(row)
        return row

    def call(self, agent: Agent, *, truncated: bool = False, thinking: bool = False) -> None:
        """One model call on the agent's current history; the harness keeps its answer."""
        prompt = agent.history + GEN
        think = [THINK, *self.words(1, 4), END_THINK, NL, NL] if thinking else []
        body = self.words(1, 8)
        sampled = think + body + ([] if truncated else [EOT])
        row = self.record(
            prompt, sampled, "length" if truncated else self.draw(st.sampled_from(["stop", "tool_calls"]))
        )
        if agent.chain is None:
            agent.chain = ExpectedChain()
            self.chains.append(agent.chain)
            context = prompt
        else:
            context = prompt[agent.close + (1 if agent.closed else 0) :]
        chain = agent.chain
        chain.request_ids.append(row["request_id"])
        chain.ids += context + sampled
        chain.mask += [0] * len(context) + [1] * len(sampled)
        chain.logprobs += [0.0] * len(context) + row["completion_logprobs"]
        # History: thinking stripped, the answer re-tokenised (drift), closed by <|im_end|>, then a tool result.
        echo = retokenize(body)
        self.drifted += echo != body
        agent.close = len(prompt) + len(echo)
        agent.closed = not truncated
        tool_result = block(USER, [1100, *self.words(1, 6)])
        if agent.kept_calls == 0:
            agent.first_tool = (len(prompt) + len(echo) + 2, len(tool_result))
        agent.kept_calls += 1
        agent.history = prompt + echo + [EOT, NL] + tool_result

    def step(self, agent: Agent) -> None:
        action = self.draw(
            st.sampled_from(
                ["turn", "turn", "turn", "think", "truncate", "retry", "error", "abort", "compact", "rewrite"]
            )
        )
        if action == "compact":
            # The harness rewrites its history into a summary: nothing before can be extended.
            self.compactions += 1
            agent.history = block(SYSTEM, agent.system) + block(USER, [1200, *self.words(1, 6)])
            agent.chain, agent.kept_calls = None, 0
        elif action == "rewrite" and agent.kept_calls >= 2:
            # The harness clears its first tool result (as micro-compaction does): the last prompt is no longer a
            # prefix, but the very first one still is — a chain resting there (a discarded retry) must not catch it.
            self.rewrites += 1
            start, length = agent.first_tool
            cleared = block(USER, [1100, 1700 + self.rewrites])  # never the same twice
            agent.history = agent.history[:start] + cleared + agent.history[start + length :]
            agent.first_tool = (start, len(cleared))
            agent.chain = None
        elif action in ("error", "abort"):
            partial = self.words(0, 3) if action == "abort" else self.draw(st.sampled_from([None, []]))
            self.record(agent.history + GEN, partial, action)  # then the harness retries the same prompt
        elif action == "retry":
            # A sample the harness threw away (timeout, resample): it ends its chain; the retry starts the next.
            self.retries += 1
            saved = agent.state()
            self.call(agent)
            agent.restore(saved)
            agent.chain = None
        self.call(agent, truncated=action == "truncate", thinking=action == "think")


@st.composite
def simulated_sessions(draw, max_sessions: int = 2) -> Simulated:
    n_sessions = draw(st.integers(1, max_sessions))
    rows: list[dict] = []
    chains: dict[str, list[ExpectedChain]] = {}
    stats = Simulated(rows=rows, chains=chains)
    for s in range(n_sessions):
        session_id = draw(st.sampled_from(["zeta", "alpha", "mid", "b-2"]).filter(lambda x: x not in chains))
        sim = SessionSimulator(draw, session_id, draw(st.sampled_from([None, f"task-{s}"])))
        n_agents = draw(st.integers(1, 3))
        agents = []
        for a in range(n_agents):
            # Distinct system prompts and first messages: a subagent never extends another agent's prompt.
            system = [2000 + a, *sim.words(0, 3)]
            agents.append(
                Agent(
                    system=system, history=block(SYSTEM, system) + block(USER, [3000 + a, *sim.words(0, 3)])
                )
            )
        for _ in range(draw(st.integers(1, 10))):
            sim.step(agents[draw(st.integers(0, n_agents - 1))])
        rows += sim.rows
        chains[session_id] = sim.chains
        stats.retries += sim.retries
        stats.compactions += sim.compactions
        stats.rewrites += sim.rewrites
        stats.drifted += sim.drifted
    return stats


def as_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=RECORD_SCHEMA)


def expected_in_output_order(sim: Simulated) -> list[ExpectedChain]:
    return [chain for session in sorted(sim.chains) for chain in sim.chains[session]]


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(sim=simulated_sessions())
def test_prefix_merging_rebuilds_exactly_the_simulated_chains(sim):
    merged, summary = merge_table(as_table(sim.rows), eot_token_id=EOT)
    expected = expected_in_output_order(sim)
    assert merged["request_ids"].to_pylist() == [c.request_ids for c in expected]
    assert merged["input_ids"].to_pylist() == [c.ids for c in expected]
    assert merged["loss_mask"].to_pylist() == [c.mask for c in expected]
    got_logprobs = merged["logprobs"].to_pylist()
    want_logprobs = [np.asarray(c.logprobs, dtype=np.float32).tolist() for c in expected]
    assert got_logprobs == want_logprobs
    # Every new sequence after a session's first one is a counted break.
    assert sum(summary.breaks.values()) == summary.sequences - len(sim.chains)
    assert summary.trainable_records == sum(len(c.request_ids) for c in expected)


@FAST
@given(sim=simulated_sessions(), data=st.data())
def test_duplicates_and_out_of_order_arrival_change_nothing(sim, data):
    rows = list(sim.rows)
    extra = data.draw(st.lists(st.sampled_from(rows), max_size=4)) if rows else []
    shuffled = data.draw(st.permutations(rows + extra))
    clean, _ = merge_table(as_table(sim.rows), eot_token_id=EOT)
    messy, summary = merge_table(as_table(shuffled), eot_token_id=EOT)
    assert messy.equals(clean)
    assert summary.excluded.get("duplicate", 0) == len(extra)


@FAST
@given(sim=simulated_sessions())
def test_every_trainable_record_is_trained_exactly_once_by_both_builders(sim):
    table = as_table(sim.rows)
    error_ids = {r["request_id"] for r in sim.rows if r["finish_reason"] in ("error", "abort")}
    for builder in ("prefix_merging", "per_request"):
        merged, summary = merge_table(table, builder=builder, eot_token_id=EOT)
        check_invariants(table, merged)
        ids = [r for group in merged["request_ids"].to_pylist() for r in group]
        assert len(ids) == len(set(ids)) == len(sim.rows) - len(error_ids)
        assert not error_ids & set(ids)
        assert summary.excluded.get("error", 0) + summary.excluded.get("abort", 0) == len(error_ids)
    assert summary.sequences == len(sim.rows) - len(error_ids)  # per_request: one each


# -- a naive reference: the routing rule written as plainly as possible -----------------------------------------


def naive_prefix_merging(rows: list[dict], eot: int) -> list[list[str]]:
    """Scan every chain, compare Python lists: slow but obviously the rule in the issue."""
    chains: list[dict] = []
    for step, turn in enumerate(prepare_session(turns_from_table(as_table(rows)))[0]):
        prompt = turn.prompt_ids.tolist()
        best = None
        for chain in chains:
            tip = chain["tip"]
            if (
                chain["open"]
                and prompt[: len(tip)] == tip
                and (best is None or (len(tip), chain["stamp"]) > (len(best["tip"]), best["stamp"]))
            ):
                best = chain
        if best is not None and eot in prompt[len(best["tip"]) :]:
            for other in chains:  # the harness went on from best's sample: chains at the same tip are done
                other["open"] = other["open"] and (other is best or other["tip"] != best["tip"])
            best["ids"].append(turn.request_id)
        else:
            best = {"ids": [turn.request_id], "open": True}
            chains.append(best)
        best.update(tip=prompt, stamp=step)
    return [c["ids"] for c in chains]


@FAST
@given(sim=simulated_sessions(max_sessions=1))
def test_routing_agrees_with_a_naive_scan_of_all_chains(sim):
    turns, _ = prepare_session(turns_from_table(as_table(sim.rows)))
    result = build_prefix_merging(turns, eot_token_id=EOT)
    assert [s.request_ids for s in result.sequences] == naive_prefix_merging(sim.rows, EOT)


@settings(max_examples=40, deadline=None)
@given(sim=simulated_sessions(max_sessions=1))
def test_hash_collisions_cannot_misroute(sim):
    """With every prefix hash equal, the router must still pick by real token comparison."""
    turns, _ = prepare_session(turns_from_table(as_table(sim.rows)))
    honest = [s.request_ids for s in build_prefix_merging(turns, eot_token_id=EOT).sequences]
    original = prefix_merging._HASHER.prefix_hashes
    prefix_merging._HASHER.prefix_hashes = lambda ids: np.zeros(len(ids), dtype=np.uint64)
    try:
        colliding = [s.request_ids for s in build_prefix_merging(turns, eot_token_id=EOT).sequences]
    finally:
        prefix_merging._HASHER.prefix_hashes = original
    assert colliding == honest


def test_the_simulator_produces_the_hard_cases():
    """Guard against a simulator that silently stopped generating drift, retries or compaction."""
    seen = {"drift": 0, "retry": 0, "compaction": 0, "rewrite": 0, "subagents": 0}

    @settings(
        max_examples=60, deadline=None, database=None, derandomize=True
    )  # a fixed set: never fails by chance
    @given(sim=simulated_sessions())
    def collect(sim):
        seen["drift"] += sim.drifted
        seen["retry"] += sim.retries
        seen["compaction"] += sim.compactions
        seen["rewrite"] += sim.rewrites
        seen["subagents"] += any(len(c) > 1 for c in sim.chains.values())

    collect()
    assert all(seen.values()), seen


# -- hand-written cases ------------------------------------------------------------------------------------------


def rows_of(*calls: tuple[list[int], list[int], str], session: str = "s") -> list[dict]:
    return [
        dict(
            schema_version=1,
            request_id=f"r{i}",
            session_id=session,
            seq=i,
            started_at=T0,
            finished_at=T0,
            provider="openai_chat",
            path="/v1/chat/completions",
            stream=False,
            prompt_ids=p,
            completion_ids=s,
            completion_logprobs=[-1.0] * len(s),
            finish_reason=f,
        )
        for i, (p, s, f) in enumerate(calls)
    ]


SYS = block(SYSTEM, [1000]) + block(USER, [1001])


def test_truncated_turn_keeps_the_prompts_end_of_turn_as_context():
    p0 = SYS + GEN
    s0 = [1002, 1003]  # finish length: no <|im_end|> sampled
    p1 = p0 + [1002, 1600, 1601, EOT, NL] + block(USER, [1004]) + GEN
    merged, _ = merge_table(
        as_table(rows_of((p0, s0, "length"), (p1, [1005, EOT], "stop"))), eot_token_id=EOT
    )
    (ids,), (mask,) = merged["input_ids"].to_pylist(), merged["loss_mask"].to_pylist()
    assert ids == p0 + s0 + [EOT, NL] + block(USER, [1004]) + GEN + [1005, EOT]
    assert mask == [0] * len(p0) + [1, 1] + [0] * (2 + len(block(USER, [1004])) + len(GEN)) + [1, 1]


def test_closed_turn_context_starts_after_the_rendered_end_of_turn():
    p0 = SYS + GEN
    s0 = [1001, 1002, EOT]
    p1 = p0 + [1500, EOT, NL] + block(USER, [1004]) + GEN  # the answer re-tokenised differently
    merged, _ = merge_table(as_table(rows_of((p0, s0, "stop"), (p1, [1005, EOT], "stop"))), eot_token_id=EOT)
    assert merged["input_ids"].to_pylist() == [p0 + s0 + [NL] + block(USER, [1004]) + GEN + [1005, EOT]]


def test_a_retried_prompt_starts_a_new_chain_and_later_turns_follow_the_retry():
    p0 = SYS + GEN
    p1 = p0 + [1002, EOT, NL] + block(USER, [1004]) + GEN
    rows = rows_of((p0, [1001, EOT], "stop"), (p0, [1002, EOT], "stop"), (p1, [1003, EOT], "stop"))
    merged, summary = merge_table(as_table(rows), eot_token_id=EOT)
    assert merged["request_ids"].to_pylist() == [["r0"], ["r1", "r2"]]
    assert summary.breaks == {BREAK_SAME_PROMPT: 1}


def test_a_prompt_that_grew_without_a_closed_turn_starts_a_new_sequence():
    p0 = SYS + GEN
    p1 = p0 + [1002, 1003]  # prefill-style continuation: no <|im_end|> after the tip
    merged, summary = merge_table(
        as_table(rows_of((p0, [1001, EOT], "stop"), (p1, [1004, EOT], "stop"))), eot_token_id=EOT
    )
    assert merged["request_ids"].to_pylist() == [["r0"], ["r1"]]
    assert summary.breaks == {prefix_merging.BREAK_NO_EOT: 1}


def test_compaction_starts_a_new_sequence_and_polar_would_drop_the_rest():
    p0 = SYS + GEN
    p1 = p0 + [1001, EOT, NL] + block(USER, [1004]) + GEN
    compacted = block(SYSTEM, [1000]) + block(USER, [1200]) + GEN
    p3 = compacted + [1006, EOT, NL] + block(USER, [1004]) + GEN
    rows = rows_of(
        (p0, [1001, EOT], "stop"),
        (p1, [1002, EOT], "stop"),
        (compacted, [1006, EOT], "stop"),
        (p3, [1007, EOT], "stop"),
    )
    merged, summary = merge_table(as_table(rows), eot_token_id=EOT)
    assert merged["request_ids"].to_pylist() == [["r0", "r1"], ["r2", "r3"]]
    assert summary.breaks == {BREAK_NO_PREFIX: 1}
    turns, _ = prepare_session(turns_from_table(as_table(rows)))
    polar = polar_routing(turns, eot_token_id=EOT)
    assert polar.chain == ["r0", "r1"] and polar.dropped == ["r2", "r3"]


def test_weight_versions_are_ordered_numerically_and_task_id_is_kept():
    p0 = SYS + GEN
    p1 = p0 + [1001, EOT, NL] + block(USER, [1004]) + GEN
    rows = rows_of((p0, [1001, EOT], "stop"), (p1, [1002, EOT], "stop"))
    rows[0].update(weight_version="10", task_id="t")
    rows[1]["weight_version"] = "9"
    merged, _ = merge_table(as_table(rows), eot_token_id=EOT)
    row = merged.to_pylist()[0]
    assert (row["weight_version_min"], row["weight_version_max"], row["task_id"]) == ("9", "10", "t")
    assert row["sequence_id"] == "s:r0" and row["n_turns"] == 2 and row["prompt_len"] == len(p0)


def test_routing_compares_tokens_with_at_most_one_chain_per_request(monkeypatch):
    """Many unrelated chains in one session: the hash table, not a token scan, picks the chain."""
    rows = rows_of(
        *[(block(SYSTEM, [1000 + i % 7, 5000 + i]) + GEN, [1001, EOT], "stop") for i in range(400)]
    )
    turns, _ = prepare_session(turns_from_table(as_table(rows)))
    calls = {"n": 0}
    real = np.array_equal

    def counting(a, b, *args, **kwargs):
        calls["n"] += 1
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(np, "array_equal", counting)
    result = build_prefix_merging(turns, eot_token_id=EOT)
    assert len(result.sequences) == 400
    assert calls["n"] == 0  # no chain tip is a prefix of any other prompt: nothing to verify


def test_prefix_merging_needs_an_end_of_turn_token():
    with pytest.raises(ValueError, match="end-of-turn"):
        build_prefix_merging([], eot_token_id=None)


def test_a_discarded_retry_does_not_catch_a_call_after_the_history_is_rewritten():
    p0 = SYS + GEN
    tool = block(USER, [1100, 1004])
    p1 = p0 + [1002, EOT, NL] + tool + GEN  # continues from the retry's answer (1002), not the first (1001)
    p2 = p1 + [1003, EOT, NL] + block(USER, [1100, 1005]) + GEN
    cleared = p0 + [1002, EOT, NL] + block(USER, [1100, 1700]) + p2[len(p0) + 3 + len(tool) :]
    rows = rows_of(
        (p0, [1001, EOT], "stop"),
        (p0, [1002, EOT], "stop"),
        (p1, [1003, EOT], "stop"),
        (p2, [1006, EOT], "stop"),
        (cleared + [1006, EOT, NL] + block(USER, [9]) + GEN, [1007, EOT], "stop"),
    )
    merged, summary = merge_table(as_table(rows), eot_token_id=EOT)
    # r0's chain ends at the retry; r4 (after the rewrite) extends no live chain, although p0 is its prefix.
    assert merged["request_ids"].to_pylist() == [["r0"], ["r1", "r2", "r3"], ["r4"]]
    assert summary.breaks == {BREAK_SAME_PROMPT: 1, BREAK_NO_PREFIX: 1}
