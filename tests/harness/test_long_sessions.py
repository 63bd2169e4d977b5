"""Long real sessions: each harness, unmodified, runs a scripted session long enough that its own compaction fires.

The scripted tiny engine plays polar_mitm/harness/long_session.py: shell calls with long outputs until the
harness compacts, a summary for its compaction call, short shell calls after it, a final answer. Each harness's
own compaction threshold is set low (its config file or environment), or — where a harness compacts only on an
overflow — the engine's context is made small, so the provider's "too long" error makes it compact and retry.

Checked on the records: the session completed; the compaction call(s) were recorded (`call_kind = "compaction"`);
merge starts a new chain after each compaction with the reason "compaction"; every answered call is in a merged
sequence (nothing dropped). A closing table gives calls, compactions, chains, breaks by reason and drops.

Also: Claude Code with a subagent (its own chain, the parent's session id); each harness's reaction when a prompt
overflows the engine's context (compacts and retries, or stops); Codex's remote compaction v2 in proxy mode (a
`/responses` call ending with a `compaction_trigger` item, answered with one compaction item). recipes/<harness>.md
say what these runs showed.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from polar_mitm.harness import HARNESSES, Harness, Hookup
from polar_mitm.harness.long_session import FINAL, PHASE_B, b_marker, long_session_script
from polar_mitm.harness.stack import HarnessStack
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.reconstruct.prefix_merging import BREAK_COMPACTION
from polar_mitm.reconstruct.turns import sequences_from_table
from polar_mitm.storage.records import RECORD_SCHEMA
from tests.summary_tables import show_table

pytestmark = pytest.mark.slow

PROMPT = "Run the numbered shell steps one by one until you are told to stop."
SCRIPT = long_session_script(a_lines=150)
B_STEPS = 5
GEMINI_TOKEN_LIMIT = 1048576  # tokenLimit() of every Gemini model name in @google/gemini-cli 0.61
RESULTS: list[dict[str, Any]] = []


# -- each harness with its compaction threshold set low ------------------------------------------------------------


def merged_json(text: str, extra: dict[str, Any]) -> str:
    """A JSON config file with `extra` merged in (nested objects merged key by key)."""

    def merge(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in more.items():
            out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
        return out

    return json.dumps(merge(json.loads(text), extra), indent=2) + "\n"


def tuned(
    base: Harness,
    *,
    json_files: dict[str, dict[str, Any]] | None = None,
    toml_top: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Harness:
    """The preset with extra settings in its config files (JSON merged, TOML top-level lines) and environment."""

    class Tuned(type(base)):  # type: ignore[misc, valid-type]
        def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
            files = super().config_files(hookup, home)
            for path, extra in (json_files or {}).items():
                files[path] = merged_json(files.get(path, "{}"), extra)
            if toml_top:  # top-level keys go before the first [table]
                path = ".codex/config.toml"
                files[path] = "\n".join(toml_top) + "\n" + files[path]
            return files

        def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
            return {**super().provider_env(hookup, home), **(env or {})}

    return Tuned()


@dataclass
class Plan:
    """How one harness is made to compact in a short session."""

    harness: Harness
    mode: str  # hook-up mode
    trigger: str  # in words, for the table and the recipes
    context_length: int | None = None  # the engine's context (None: the model's own)
    script: dict[str, Any] = field(default_factory=lambda: SCRIPT)
    b_steps: int = B_STEPS  # shell calls after the compaction
    resume: list[str] | None = None  # a harness that compacts only between prompts: args of a second prompt


def plans() -> dict[str, Plan]:
    """Thresholds ≈ the harness's own prompt + ~4.5k tokens: phase A (≈1.1k tokens a step) crosses it after 4
    steps; after the compaction (prompt + summary) the harness is well below it again."""
    return {
        # Claude Code: threshold = min(effective window × pct, effective window − 13k), effective window = window −
        # min(max output, 20k); the window env var is floored at 100k, the percentage is not.
        "claude-code": Plan(
            tuned(
                HARNESSES["claude-code"],
                env={"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "20"},
            ),
            "proxy",
            "CLAUDE_CODE_AUTO_COMPACT_WINDOW=100000 + CLAUDE_AUTOCOMPACT_PCT_OVERRIDE=20 "
            "(auto-compact at 16k tokens)",
        ),
        # Codex: auto-compacts once the last response's total tokens reach the limit. A custom provider
        # (base-URL mode) compacts locally: a plain /responses call with its compaction prompt.
        "codex": Plan(
            tuned(HARNESSES["codex"], toml_top=["model_auto_compact_token_limit = 12500"]),
            "base-url",
            "config.toml model_auto_compact_token_limit = 12500",
        ),
        # Gemini CLI: compresses when the last prompt's token count ≥ model.compressionThreshold × tokenLimit, but
        # only history before a user message that is not a tool result (findCompressSplitPoint): inside one
        # prompt's tool loop there is none, so it compresses when a second prompt resumes the session (`-r
        # latest`), where the count is its estimate of the resumed history (~chars/4: ~3k tokens here).
        "gemini": Plan(
            tuned(
                HARNESSES["gemini"],
                json_files={
                    ".gemini/settings.json": {"model": {"compressionThreshold": 1500 / GEMINI_TOKEN_LIMIT}}
                },
            ),
            "base-url",
            "settings.json model.compressionThreshold = 1500/1048576; second prompt with -r latest",
            script=long_session_script(a_steps=8, b_steps=0, a_lines=150, a_final="Phase A is done."),
            b_steps=0,
            resume=["-r", "latest"],
        ),
        # Qwen Code: auto threshold = min(pct × window, window − 20k − 13k) (pct × window below 33k).
        "qwen": Plan(
            tuned(
                HARNESSES["qwen"],
                json_files={
                    ".qwen/settings.json": {
                        "model": {"generationConfig": {"contextWindowSize": 25000}},
                        "context": {"autoCompactThreshold": 0.86},
                    }
                },
            ),
            "base-url",
            "settings.json contextWindowSize 25000, context.autoCompactThreshold 0.86 (21.5k)",
        ),
        # opencode: compacts once the last step's tokens ≥ limit.context − limit.output.
        "opencode": Plan(
            tuned(
                HARNESSES["opencode"],
                json_files={
                    ".config/opencode/opencode.json": {
                        "provider": {
                            "polar": {
                                "models": {"polar-model": {"limit": {"context": 15700, "output": 4096}}}
                            }
                        }
                    }
                },
            ),
            "base-url",
            "opencode.json model limit {context: 15700, output: 4096}",
        ),
        # Pi: the threshold check runs only when the agent ends (after the answer), so a one-shot run compacts
        # mid-session only on an overflow: the engine's context is small and Pi compacts and retries. Each step adds
        # ~1140 prompt tokens (4786 → 5926 at the 4th/5th call, ± a few dozen with the machine's paths): 5600 leaves
        # the 4th call ~740 tokens of room and puts the 5th clearly over (6000 left it 0-70 tokens: a cut answer).
        "pi": Plan(
            tuned(
                HARNESSES["pi"],
                json_files={
                    ".pi/agent/settings.json": {
                        "compaction": {"enabled": True, "reserveTokens": 2048, "keepRecentTokens": 400}
                    }
                },
            ),
            "base-url",
            "engine --context-length 5600 → overflow error → compact and retry",
            context_length=5600,
        ),
    }


# -- the stack ---------------------------------------------------------------------------------------------------


def start_stack(root: Path, script: dict[str, Any], *, context_length: int | None) -> HarnessStack:
    """The scripted engine (with `--context-length` when given) and the gateway."""
    return HarnessStack.start(
        root, script, engine_args=["--context-length", str(context_length)] if context_length else None
    )


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory):
    """The stack of every run that plays SCRIPT on the model's own context (four long sessions and Codex's remote
    compaction): one engine and gateway for them all, each run in a folder of its own, its records by session."""
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the harness CLIs need it")
    stack = start_stack(tmp_path_factory.mktemp("long-shared"), SCRIPT, context_length=None)
    yield stack
    stack.stop()


@contextmanager
def stack_for(request, root: Path, script: dict[str, Any], context_length: int | None):
    """The shared stack where it plays this script on the model's context; a stack of the run's own otherwise."""
    if script is SCRIPT and context_length is None:
        yield request.getfixturevalue("shared_stack")
        return
    stack = start_stack(root, script, context_length=context_length)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module", autouse=True)
def report_table(request):
    yield
    if not RESULTS:
        return
    lines = [
        f"{'harness':22} {'calls':>5} {'main':>4} {'compact':>7} {'errors':>6} {'chains':>6} "
        f"{'drops':>5} {'wall':>6}  breaks by reason"
    ]
    for r in RESULTS:
        breaks = ", ".join(f"{k}: {v}" for k, v in sorted(r["breaks"].items())) or "-"
        lines.append(
            f"{r['harness']:22} {r['calls']:5} {r['main']:4} {r['compactions']:7} "
            f"{r['errors']:6} {r['chains']:6} {r['drops']:5} {r['wall_s']:5.0f}s  {breaks}"
            + (f"  → {r['reaction']}" if "reaction" in r else "")
        )
    show_table(request.config, "long real sessions with the harness's own compaction:", lines)


def merge_session(rows: list[dict[str, Any]], eot_id: int) -> tuple[list, dict[str, int], int]:
    """(merged sequences, breaks by reason, answered calls found in no sequence)."""
    table, summary = merge_table(pa.Table.from_pylist(rows, schema=RECORD_SCHEMA), eot_token_id=eot_id)
    sequences = sequences_from_table(table)
    merged = {rid for seq in sequences for rid in seq.request_ids}
    answered = {r["request_id"] for r in rows if r["status_code"] == 200 and r["completion_ids"]}
    return sequences, dict(summary.breaks), len(answered - merged)


# -- the test ------------------------------------------------------------------------------------------------------


# The six with a long-session plan (plans()); the later presets' recipes say how, or whether, they compact.
@pytest.mark.parametrize("name", ["claude-code", "codex", "gemini", "qwen", "pi", "opencode"])
def test_long_session_compacts_and_merges_without_drops(tmp_path_factory, tiny_engine, request, name):
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the harness CLIs need it")
    plan = plans()[name]
    own = tmp_path_factory.mktemp(f"long-{name}")
    with stack_for(request, own, plan.script, plan.context_length) as stack:
        session = f"long-{name}-{uuid.uuid4().hex[:8]}"
        work, home = own / "work", own / "home"
        run = stack.run(
            plan.harness,
            PROMPT,
            mode=plan.mode,
            session=session,
            task="long-task",
            workspace=work,
            home=home,
            timeout=420,
        )
        if plan.resume is not None and run.returncode == 0:
            first_wall = run.wall_s
            run = stack.run(
                plan.harness,
                "Continue with the next steps.",
                mode=plan.mode,
                session=session,
                task="long-task",
                workspace=work,
                home=home,
                timeout=300,
                args=plan.resume,
            )
            run.wall_s += first_wall
        rows = stack.records(session)
    eot = tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    sequences, breaks, drops = merge_session(rows, eot)
    kinds = Counter(r["call_kind"] for r in rows)
    result = {
        "harness": name,
        "calls": len(rows),
        "main": kinds["main"],
        "compactions": kinds["compaction"],
        "errors": sum(r["status_code"] != 200 for r in rows),
        "chains": len(sequences),
        "drops": drops,
        "breaks": breaks,
        "wall_s": run.wall_s,
    }
    RESULTS.append(result)
    context = (
        run.describe()
        + f"\nlogs: {stack.root} (this run's folder: {own})\n{result}\n"
        + "\n".join(
            f"{r['seq']:3} {r['call_kind']:10} {r['status_code']} {r['prompt_tokens']!s:>6} "
            f"{r['finish_reason']}"
            for r in rows
        )
    )

    assert run.returncode == 0, context
    assert len(rows) >= 12, context
    assert kinds["compaction"] >= 1, context  # the harness's own compaction fired and was recorded
    decode = tiny_engine.tokenizer.decode
    texts = {r["request_id"]: decode(r["completion_ids"], skip_special_tokens=True) for r in rows}
    # The session went on from the summary: the B steps ran after the (last) compaction, then the final answer.
    last_compaction = max(r["seq"] for r in rows if r["call_kind"] == "compaction")
    after = [r for r in rows if r["seq"] > last_compaction and r["call_kind"] == "main"]
    assert any(PHASE_B in r["messages_json"] for r in after), context
    if plan.b_steps:
        assert any(b_marker(plan.b_steps) in texts[r["request_id"]] for r in after), context
    assert any(texts[r["request_id"]] == FINAL for r in after), context
    # Merge: a new chain after each compaction, named for it; every answered call is in a sequence.
    assert breaks.get(BREAK_COMPACTION, 0) >= 1, context
    assert drops == 0, context
    chain_of = {rid: i for i, seq in enumerate(sequences) for rid in seq.request_ids}
    before = [
        r
        for r in rows
        if r["seq"] < last_compaction and r["call_kind"] == "main" and r["request_id"] in chain_of
    ]
    assert before and after, context
    assert chain_of[before[0]["request_id"]] != chain_of[after[-1]["request_id"]], context


# -- Claude Code with a subagent ---------------------------------------------------------------------------------

SUBAGENT_TASK = "Run the subagent step and report back."
SUBAGENT_SCRIPT = {
    "turns": [
        {
            "text": "I will hand this to a subagent.",
            "tool_call": {
                "name": ["Agent", "Task"],
                "arguments": {
                    "description": "Run the subagent step",
                    "prompt": SUBAGENT_TASK,
                    "subagent_type": "general-purpose",
                    "run_in_background": False,
                },
            },
        }
    ],
    "side": "Subagent step",
    "replies": [
        # main thread, once the Agent tool's result (the subagent's answer) is back
        {"when": "SUBAGENT-DONE", "text": FINAL},
        # the subagent, after its shell call
        {"when": "SUBAGENT-STEP", "text": "SUBAGENT-DONE: the step ran."},
        # the subagent's first call: its task is its user message
        {
            "when": SUBAGENT_TASK,
            "text": "Running the step.",
            "tool_call": {
                "name": ["Bash"],
                "arguments": {"command": "echo SUBAGENT-STEP", "description": "Run the step"},
            },
        },
    ],
}


def first_user_text(row: dict[str, Any]) -> str:
    user = next((m for m in json.loads(row["messages_json"]) if m["role"] == "user"), None)
    return json.dumps(user["content"]) if user else ""


def test_claude_code_subagent_has_its_own_chain_and_the_session_id(tmp_path_factory, tiny_engine):
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the harness CLIs need it")
    stack = start_stack(tmp_path_factory.mktemp("subagent"), SUBAGENT_SCRIPT, context_length=None)
    try:
        session = f"subagent-{uuid.uuid4().hex[:8]}"
        run = stack.run(
            HARNESSES["claude-code"],
            "Have a subagent run the step.",
            mode="proxy",
            session=session,
            task="subagent-task",
            workspace=stack.root / "work",
            home=stack.root / "home",
            timeout=300,
        )
        rows = stack.records(session)  # the subagent's calls are found by the parent's session id
    finally:
        stack.stop()
    context = (
        run.describe()
        + "\n"
        + "\n".join(
            f"{r['seq']:3} {r['call_kind']:10} {r['status_code']} {r['finish_reason']} {first_user_text(r)[:80]}"
            for r in rows
        )
    )
    assert run.returncode == 0, context
    eot = tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    sequences, breaks, drops = merge_session(rows, eot)
    main = [r for r in rows if r["call_kind"] == "main" and "subagent run the step" in first_user_text(r)]
    sub = [
        r for r in rows if r["call_kind"] == "main" and SUBAGENT_TASK in first_user_text(r) and r not in main
    ]
    kinds = Counter(r["call_kind"] for r in rows)
    RESULTS.append(
        {
            "harness": "claude+agent",
            "calls": len(rows),
            "main": kinds["main"],
            "compactions": kinds["compaction"],
            "errors": sum(r["status_code"] != 200 for r in rows),
            "chains": len(sequences),
            "drops": drops,
            "breaks": breaks,
            "wall_s": run.wall_s,
        }
    )
    assert len(main) >= 2 and len(sub) >= 2, context
    assert all(r["session_id"] == session and r["task_id"] == "subagent-task" for r in sub)
    texts = [tiny_engine.tokenizer.decode(r["completion_ids"], skip_special_tokens=True) for r in main]
    assert texts[-1] == FINAL, context  # the main thread finished after the subagent's answer came back
    chain_of = {rid: i for i, seq in enumerate(sequences) for rid in seq.request_ids}
    main_chains = {chain_of[r["request_id"]] for r in main}
    sub_chains = {chain_of[r["request_id"]] for r in sub}
    assert len(main_chains) == 1 and len(sub_chains) == 1 and main_chains != sub_chains, (
        main_chains,
        sub_chains,
    )
    assert drops == 0, context


# -- context overflow: each harness's reaction to the provider's own "too long" error ----------------------------

# The engine's context: the harness's first prompt (measured here, engine tokens) + ~3k, so phase A overflows
# it after three steps. The harness presets are the plain ones (no compaction settings).
OVERFLOW_CONTEXT = {"claude-code": 14900, "codex": 10800, "gemini": 12900, "qwen": 20300, "opencode": 10200}
OVERFLOW_MODE = {
    "claude-code": "proxy",
    "codex": "base-url",
    "gemini": "base-url",
    "qwen": "base-url",
    "opencode": "base-url",
}
OVERFLOW_SCRIPT = long_session_script(a_lines=150, b_steps=1)  # one call after the compaction is enough here
# What each harness does, observed (Pi: see its long session above — it compacts and retries once).
OVERFLOW_REACTION = {
    "claude-code": "compacts and retries",
    "codex": "stops with the error",  # "Codex ran out of room in the model's context window" (exit 1)
    "gemini": "stops with the error",
    "qwen": "compacts and retries",
    "opencode": "compacts and retries",
}


@pytest.mark.parametrize("name", list(OVERFLOW_CONTEXT))
def test_context_overflow_reaction(tmp_path_factory, tiny_engine, name):
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the harness CLIs need it")
    stack = start_stack(
        tmp_path_factory.mktemp(f"overflow-{name}"), OVERFLOW_SCRIPT, context_length=OVERFLOW_CONTEXT[name]
    )
    try:
        session = f"overflow-{name}-{uuid.uuid4().hex[:8]}"
        run = stack.run(
            HARNESSES[name],
            PROMPT,
            mode=OVERFLOW_MODE[name],
            session=session,
            task="overflow-task",
            workspace=stack.root / "work",
            home=stack.root / "home",
            timeout=300,
        )
        rows = stack.records(session)
    finally:
        stack.stop()
    errors = [r for r in rows if r["status_code"] != 200]
    context = (
        run.describe()
        + "\n"
        + "\n".join(
            f"{r['seq']:3} {r['call_kind']:10} {r['status_code']} {r['prompt_tokens']!s:>6} {r['finish_reason']} "
            f"{(r['error'] or '')[:90]}"
            for r in rows
        )
    )
    assert errors, context  # the engine's context was overflowed
    assert all("context length" in (r["error"] or "") for r in errors), context
    first_error = min(r["seq"] for r in errors)
    compacted = any(r["call_kind"] == "compaction" and r["seq"] > first_error for r in rows)
    retried = any(
        r["call_kind"] == "main" and r["status_code"] == 200 and r["seq"] > first_error for r in rows
    )
    reaction = (
        "compacts and retries"
        if compacted and retried
        else "compacts"
        if compacted
        else "retries without compacting"
        if retried
        else "stops with the error"
    )
    eot = tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    sequences, breaks, drops = merge_session(rows, eot)
    kinds = Counter(r["call_kind"] for r in rows)
    RESULTS.append(
        {
            "harness": f"{name} (overflow)",
            "calls": len(rows),
            "main": kinds["main"],
            "compactions": kinds["compaction"],
            "errors": len(errors),
            "chains": len(sequences),
            "drops": drops,
            "breaks": breaks,
            "wall_s": run.wall_s,
            "reaction": reaction,
        }
    )
    assert drops == 0, context
    assert reaction == OVERFLOW_REACTION[name], context


# -- Codex's remote compaction, proxy mode ---------------------------------------------------------------------


def test_codex_remote_compaction_v2_in_proxy_mode(tmp_path_factory, tiny_engine, request):
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the harness CLIs need it")
    own = tmp_path_factory.mktemp("codex-v2")
    with stack_for(request, own, SCRIPT, None) as stack:
        session = f"codex-v2-{uuid.uuid4().hex[:8]}"
        run = stack.run(
            plans()["codex"].harness,
            PROMPT,
            mode="proxy",
            session=session,
            task="long-task",
            workspace=own / "work",
            home=own / "home",
            timeout=300,
        )
        rows = stack.records(session)
    context = (
        run.describe()
        + "\n"
        + "\n".join(
            f"{r['seq']:3} {r['call_kind']:10} {r['status_code']} {r['stream']} {r['path']}" for r in rows
        )
    )
    assert run.returncode == 0, context
    compactions = [r for r in rows if r["call_kind"] == "compaction"]
    assert compactions, context
    # v2: a streamed /responses call whose input ends with a compaction_trigger item, answered with one compaction
    # item; the session goes on from the summary (the B steps, then the final answer), in a new chain.
    assert all(r["path"].endswith("/responses") and r["stream"] for r in compactions), context
    assert all(
        json.loads(r["request_json"])["input"][-1]["type"] == "compaction_trigger" for r in compactions
    )
    assert all(
        [item["type"] for item in json.loads(r["response_json"])["output"]] == ["compaction"]
        for r in compactions
    ), context
    last_compaction = max(r["seq"] for r in compactions)
    after = [r for r in rows if r["seq"] > last_compaction and r["call_kind"] == "main"]
    assert any(PHASE_B in r["messages_json"] for r in after), context
    texts = [tiny_engine.tokenizer.decode(r["completion_ids"], skip_special_tokens=True) for r in after]
    assert any(b_marker(B_STEPS) in text for text in texts) and FINAL in texts, context
    _, breaks, drops = merge_session(rows, tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert breaks.get(BREAK_COMPACTION, 0) >= 1 and drops == 0, context
