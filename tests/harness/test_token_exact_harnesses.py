"""The real harness CLIs (six npm CLIs, mini-swe-agent, Aider, Cline, Kilo, Hermes, OpenClaw, OpenHands), proxy
mode, in both prompt modes: how many sampled tokens are trained in the exact context the engine sampled them in.

Scripted multi-turn session (polar_mitm/harness/policy.py): turn 1 thinks, then three shell tool calls, then a
final answer. In `tokens` mode every harness reaches 100% context-exact sampled tokens and its main thread (the
calls that offer tools) merges into one sequence (Aider and OpenClaw, whose calls never extend the last one: one
per call); in `messages` mode the harnesses that rewrite their history —
Gemini CLI drops thought parts, Pi, Qwen Code, Cline and Hermes re-serialise tool arguments compactly, OpenHands
drops our reasoning_content — drift below 100%.
"""

from __future__ import annotations

import shutil
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from polar_mitm.harness import HARNESSES
from polar_mitm.harness.aider import FAIL_ONCE_ARGS
from polar_mitm.harness.policy import shell_script
from polar_mitm.harness.stack import HarnessStack
from polar_mitm.reconstruct.fidelity import sequence_fidelity
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.reconstruct.turns import sequences_from_table
from polar_mitm.storage.records import RECORD_SCHEMA
from tests.summary_tables import show_table

pytestmark = pytest.mark.slow

COMMANDS = ["ls", "echo hello > out.txt", "cat out.txt"]
FINAL = "Done: out.txt says hello."
SCRIPT = shell_script(COMMANDS, FINAL)
PROMPT = "Write hello into out.txt"
REWRITING = {
    "gemini",
    "pi",
    "qwen",
    "cline",
    "hermes",
    "openhands",
}  # harnesses whose resent history differs from the sampled tokens
# Aider rebuilds every prompt: the files it added to the chat go before the conversation, its format reminder
# after it, and an applied edit is followed by its canned "I updated the files." — no call extends the last one.
# OpenClaw ends every request with a user message of runtime facts that the next request leaves out of its
# history, so no call extends the last one either (tests/harness/test_quirks.py).
REBUILDING = {"aider", "openclaw"}
# Run in tokens mode only, to keep the suite short: the messages-mode run would assert nothing more than opencode's.
TOKENS_MODE_ONLY = {"kilo"}
RESULTS: dict[tuple[str, str], dict[str, Any]] = {}
# Aider has no tools: its loop is edit → its test command → a fix when the test fails (the test fails once).
EXTRA_ARGS = {"aider": FAIL_ONCE_ARGS}


@pytest.fixture(scope="module", params=["tokens", "messages"])
def stack(request, tmp_path_factory):
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the harness CLIs need it")
    mode = request.param
    stack = HarnessStack.start(
        tmp_path_factory.mktemp(f"exact-{mode}"), SCRIPT, gateway_options={"polar_prompt_mode": mode}
    )
    stack.prompt_mode = mode
    yield stack
    stack.stop()


@pytest.fixture(scope="module", autouse=True)
def report_table(request):
    yield
    if not RESULTS:
        return
    lines = [f"{'harness':15} {'tokens mode':>30} {'messages mode':>30}"]
    for name in HARNESSES:
        cells = []
        for mode in ("tokens", "messages"):
            r = RESULTS.get((name, mode))
            cells.append(
                f"{r['share']:6.1%} ({r['exact']}/{r['sampled']}) Δlp {r['logprob_gap']:.0e}" if r else "–"
            )
        lines.append(f"{name:15} {cells[0]:>30} {cells[1]:>30}")
    show_table(request.config, "context-exact sampled tokens per harness (proxy mode):", lines)


def max_logprob_gap(tiny_engine, sequences) -> float:
    """Largest |forward-pass logprob − recorded logprob| over sampled tokens: the trainer's step 0 (same weights)."""
    worst = 0.0
    for seq in sequences:
        ids = [int(t) for t in seq.input_ids]
        scored = np.asarray(tiny_engine.score(ids[: seq.prompt_len], ids[seq.prompt_len :]))
        mask = np.asarray(seq.loss_mask[seq.prompt_len :], dtype=bool)
        worst = max(
            worst, float(np.abs(scored[mask] - np.asarray(seq.logprobs[seq.prompt_len :])[mask]).max())
        )
    return worst


def fidelity(rows: list[dict[str, Any]], eot_id: int, tiny_engine) -> dict[str, Any]:
    records = pa.Table.from_pylist(rows, schema=RECORD_SCHEMA)
    table, _ = merge_table(records, eot_token_id=eot_id)
    prompts = {r["request_id"]: np.asarray(r["prompt_ids"], dtype=np.int32) for r in rows}
    # Aider offers no tools: all of its calls are its loop.
    main_ids = {r["request_id"] for r in rows if r["tools_json"] != "[]"} or {r["request_id"] for r in rows}
    exact = sampled = 0
    main_sequences = 0
    sequences = sequences_from_table(table)
    for seq in sequences:
        f = sequence_fidelity(seq.input_ids, seq.loss_mask, seq.request_ids, prompts)
        exact, sampled = exact + f.exact_tokens, sampled + f.sampled_tokens
        main_sequences += bool(main_ids & set(seq.request_ids))
    return {
        "exact": exact,
        "sampled": sampled,
        "share": exact / sampled,
        "main_sequences": main_sequences,
        "logprob_gap": max_logprob_gap(tiny_engine, sequences),
    }


@pytest.mark.parametrize("name", list(HARNESSES))
def test_harness_session_is_context_exact_in_tokens_mode(stack, tiny_engine, tmp_path, name):
    mode = stack.prompt_mode
    if mode == "messages" and name in TOKENS_MODE_ONLY:
        pytest.skip(f"{name}: tokens mode only (an opencode fork that does not rewrite history; ~26 s a run)")
    session = f"{name}-{mode}-{uuid.uuid4().hex[:8]}"
    run = stack.run(
        HARNESSES[name],
        PROMPT,
        mode="proxy",
        session=session,
        task="exact-task",
        workspace=tmp_path / "work",
        home=tmp_path / "home",
        timeout=300,
        args=EXTRA_ARGS.get(name),
    )
    rows = stack.records(session)
    context = run.describe() + f"\nlogs: {stack.root}"
    assert run.returncode == 0, context
    assert (run.workspace / "out.txt").read_text() == "hello\n", context
    main = [r for r in rows if r["tools_json"] != "[]"] or rows
    if name == "aider":  # the edit, then the same edit again after the failed test run
        assert [r["finish_reason"] for r in rows] == ["stop", "stop"], context
    else:
        submits = (
            name == "mini-swe-agent"
        )  # its last turn is FINAL + its submit command (policy.shell_script)
        assert sum(r["finish_reason"] == "tool_calls" for r in main) == len(COMMANDS) + submits, context
    assert all(r["status_code"] == 200 for r in rows)
    result = fidelity(rows, tiny_engine.tokenizer.convert_tokens_to_ids("<|im_end|>"), tiny_engine)
    RESULTS[(name, mode)] = result
    if mode == "tokens" and name in REBUILDING:
        # Each call is its own chain ("no prefix match"), each exact: nothing is trained out of context.
        assert result["share"] == 1.0 and result["main_sequences"] == len(main), result
        assert [r["splice_reason"] for r in main[1:]] == ["no prefix match"] * (len(main) - 1)
        assert result["logprob_gap"] <= 1e-4, result
    elif mode == "tokens":
        assert result["share"] == 1.0, result
        assert result["main_sequences"] == 1, result
        assert result["logprob_gap"] <= 1e-4, result  # trainer logprobs at step 0 == behaviour logprobs
        assert {r["prompt_mode"] for r in main[1:]} == {"tokens"}, [r["splice_reason"] for r in main]
    elif name in REWRITING:
        assert result["share"] < 1.0, result  # the drift that tokens mode removes
        assert result["logprob_gap"] > 1e-4, result  # ... and the wrong importance ratios it causes
