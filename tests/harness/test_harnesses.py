"""The real agent CLIs (six npm CLIs, mini-swe-agent, Aider, Cline, Kilo, Hermes, OpenClaw, OpenHands),
unmodified, end to end through the gateway, in both hook-up modes.

Each run is a one-shot prompt against the scripted tiny engine (polar_mitm/harness/policy.py): turn 1 thinks and
calls the harness's own shell tool with `echo hello > out.txt`, turn 2 answers. The harness must parse our tool
call, run it in its workspace, send the result back and finish with exit code 0; the gateway must record every
call with ids and true logprobs, and its side traffic (title generation, routing classifiers, settings probes,
model lists, WebSocket attempts) must not break it. Engine, gateway and harnesses share a private,
loopback-only network namespace where this machine allows one (polar_mitm/harness/netns.py).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from polar_mitm.harness import HARNESSES, MODES
from polar_mitm.harness.mini_swe_agent import SUBMIT_COMMAND
from polar_mitm.harness.openhands import DEFAULT_TOOLS
from polar_mitm.harness.policy import AIDER_EDIT, HELLO_SCRIPT, THINKING
from polar_mitm.harness.stack import HarnessRun, HarnessStack
from tests.summary_tables import show_table

pytestmark = pytest.mark.slow

PROMPT = "Write hello into out.txt"
FINAL = HELLO_SCRIPT["turns"][-1]
RESULTS: list[dict[str, Any]] = []
# Harnesses that end only by a tool call (mini-swe-agent's submit command): their last turn is FINAL + that call.
FINISHES_BY_TOOL = {"mini-swe-agent": SUBMIT_COMMAND}
# Harnesses that end every request with a message the next one leaves out of its history (OpenClaw's runtime
# facts): the follow-up re-sends everything before it, then the answer and the tool result, then fresh facts.
DROPS_LAST_MESSAGE = {"openclaw"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, request):
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the harness CLIs need it")
    stack = HarnessStack.start(tmp_path_factory.mktemp("harness-stack"), HELLO_SCRIPT)
    yield stack
    stack.stop()
    report(request.config, stack.isolation)


def report(config: pytest.Config, isolation: str) -> None:
    """The closing table (harness, version, mode, turns, records, pass, wall time), shown even with -q."""
    if not RESULTS:
        return
    lines = [f"{'harness':15} {'version':9} {'mode':9} turns records pass  wall"]
    for r in RESULTS:
        lines.append(
            f"{r['harness']:15} {r['version']:9} {r['mode']:9} {r['turns']:5} {r['records']:7} "
            f"{'yes' if r['passed'] else 'NO':5} {r['wall_s']:5.1f}s"
        )
    show_table(config, f"real harnesses through the gateway ({isolation}):", lines)


def messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    return json.loads(row["messages_json"])


# -- per-harness checks of the quirks the gateway handles, on what the real CLI sent ------------------------------


def claude_code_checks(rows: list[dict[str, Any]], mode: str) -> None:
    for row in rows:
        # The billing line changes every request: kept in request_json, never shown to the engine.
        assert "x-anthropic-billing-header" in row["request_json"]
        assert "x-anthropic-billing-header" not in row["messages_json"]
        # Deferred tools (ToolSearch shape) stay out of the prompt until loaded.
        if '"defer_loading": true' in row["request_json"]:
            assert "DeferredToolPlaceholder" not in row["tools_json"]
    if mode == "proxy":
        assert {row["host"] for row in rows} == {"api.anthropic.com"}
    # Its environment block arrives as a mid-conversation system message.
    assert any(m["role"] == "system" for m in messages(rows[0])[1:])


def reasoning_round_trip(rows: list[dict[str, Any]], mode: str) -> None:
    """Responses reasoning items (store: false + encrypted_content) come back with the exact text."""
    body = json.loads(rows[0]["request_json"])
    assert body.get("store") is False and "reasoning.encrypted_content" in body.get("include", [])
    assistant = [m for m in messages(rows[-1]) if m["role"] == "assistant"]
    assert assistant and assistant[0]["reasoning"] == THINKING


def codex_checks(rows: list[dict[str, Any]], mode: str) -> None:
    reasoning_round_trip(rows, mode)
    assert any(m["role"] == "system" for m in messages(rows[0])), "developer messages become system turns"


def pi_checks(rows: list[dict[str, Any]], mode: str) -> None:
    if mode == "proxy":  # the built-in openai provider speaks Responses; ours speaks Chat Completions
        reasoning_round_trip(rows, mode)


def gemini_checks(rows: list[dict[str, Any]], mode: str) -> None:
    assert all("thinkingConfig" in row["request_json"] for row in rows if row["tools_json"] != "[]")


def mini_swe_agent_checks(rows: list[dict[str, Any]], mode: str) -> None:
    """litellm's openai/ provider: Chat Completions with exactly one tool, no side traffic."""
    for row in rows:
        assert row["provider"] == "openai_chat" and [t["name"] for t in json.loads(row["tools_json"])] == [
            "bash"
        ]
    if mode == "proxy":
        assert {row["host"] for row in rows} == {"api.openai.com"}


def hermes_checks(rows: list[dict[str, Any]], mode: str) -> None:
    """Its built-in openai-api provider speaks Responses to api.openai.com (reasoning sent back sealed); its custom
    provider, Chat Completions. Both offer the terminal and file toolsets (terminal among six tools)."""
    if mode == "proxy":
        assert {row["host"] for row in rows} == {"api.openai.com"}
        assert {row["provider"] for row in rows} == {"openai_responses"}
        reasoning_round_trip(rows, mode)
    else:
        assert {row["provider"] for row in rows} == {"openai_chat"}
    for row in rows:
        assert "terminal" in [t["name"] for t in json.loads(row["tools_json"])]
        assert len(json.loads(row["tools_json"])) == 6


def openhands_checks(rows: list[dict[str, Any]], mode: str) -> None:
    """litellm's openai/ provider, as the OpenHands SDK calls it: Chat Completions, not streamed, a constant
    `prompt_cache_key` (the conversation id), the CLI's six tools; our tool call ran with the `security_risk` its
    LLM security analyzer requires, and the tool result came back as the terminal's observation."""
    requests = [json.loads(row["request_json"]) for row in rows]
    for request in requests:
        assert not request.get("stream") and request["model"] == "gpt-4.1-mini"
        assert [t["function"]["name"] for t in request["tools"]] == DEFAULT_TOOLS
    assert len({r["prompt_cache_key"] for r in requests}) == 1
    call = next(m for m in requests[1]["messages"] if m.get("tool_calls"))["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) == {"command": "echo hello > out.txt", "security_risk": "LOW"}
    result = next(m for m in requests[1]["messages"] if m["role"] == "tool")
    assert "[The command completed with exit code 0.]" in result["content"][0]["text"], result
    if mode == "proxy":
        assert {row["host"] for row in rows} == {"api.openai.com"}


CHECKS: dict[str, Callable[[list[dict[str, Any]], str], None]] = {
    "claude-code": claude_code_checks,
    "codex": codex_checks,
    "pi": pi_checks,
    "gemini": gemini_checks,
    "mini-swe-agent": mini_swe_agent_checks,
    "hermes": hermes_checks,
    "openhands": openhands_checks,
}


# -- the test ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(HARNESSES))
def test_real_harness_makes_a_tool_call_and_finishes_through_the_gateway(
    stack, tiny_engine, tmp_path, name, mode
):
    harness = HARNESSES[name]
    session, task = f"{name}-{mode}-{uuid.uuid4().hex[:8]}", "hello-task"
    result = {
        "harness": name,
        "version": harness.installed_version() or "?",
        "mode": mode,
        "turns": 0,
        "records": 0,
        "passed": False,
        "wall_s": 0.0,
    }
    RESULTS.append(result)
    run = stack.run(
        harness,
        PROMPT,
        mode=mode,
        session=session,
        task=task,
        workspace=tmp_path / "work",
        home=tmp_path / "home",
        timeout=240,
    )
    rows = stack.records(session)
    loop = [r for r in rows if r["tools_json"] != "[]"] if harness.shell_tools else rows  # Aider: no tools
    result.update(records=len(rows), wall_s=run.wall_s, turns=len(loop))
    api = (harness.base_url_api or harness.api) if mode != "proxy" else harness.api
    assert {r["provider"] for r in loop} == {api}, (
        name,
        mode,
    )  # what `polar-mitm harness list` says it speaks
    if harness.shell_tools:
        check_run(run, rows, stack, name, mode, task, tiny_engine)
    else:
        check_edit_run(run, rows, stack, mode, task, tiny_engine)
    result["passed"] = True


def check_record(row: dict[str, Any], mode: str, task: str) -> None:
    """Every call, side traffic included, was answered and recorded in full."""
    assert row["status_code"] == 200 and row["error"] is None, row["error"]
    assert row["task_id"] == task and row["request_id"].startswith("req_")
    assert row["mode"] == ("regular" if mode == "proxy" else "reverse")
    assert row["session_source"] == ("proxy_auth" if mode == "proxy" else "path")
    assert row["prompt_ids"] and row["prompt_tokens"] == len(row["prompt_ids"])
    assert len(row["completion_ids"]) == len(row["completion_logprobs"]) > 0
    assert all(lp <= 0.0 for lp in row["completion_logprobs"])


def check_edit_run(
    run: HarnessRun, rows: list[dict[str, Any]], stack: HarnessStack, mode: str, task: str, tiny_engine
) -> None:
    """A harness without tools (Aider): one call, answered with the file in its edit format, which it applies."""
    context = run.describe() + f"\nengine and gateway logs: {stack.root}"
    assert run.returncode == 0, context
    assert (run.workspace / "out.txt").read_text() == "hello\n", context  # our edit was parsed and applied
    assert len(rows) == 1, context
    [row] = rows
    check_record(row, mode, task)
    assert row["provider"] == "openai_chat" and row["tools_json"] == "[]" and row["finish_reason"] == "stop"
    assert tiny_engine.tokenizer.decode(row["completion_ids"], skip_special_tokens=True) == AIDER_EDIT["text"]
    if mode == "proxy":
        assert row["host"] == "api.openai.com"
    scored = tiny_engine.score(row["prompt_ids"], row["completion_ids"])
    assert max(abs(a - b) for a, b in zip(scored, row["completion_logprobs"], strict=True)) < 1e-3


def check_run(
    run: HarnessRun,
    rows: list[dict[str, Any]],
    stack: HarnessStack,
    name: str,
    mode: str,
    task: str,
    tiny_engine,
) -> None:
    context = run.describe() + f"\nengine and gateway logs: {stack.root}"
    assert run.returncode == 0, context
    out = run.workspace / "out.txt"
    assert out.exists() and out.read_text() == "hello\n", context  # our tool call was parsed and run
    assert len(rows) >= 2, context

    for row in rows:
        check_record(row, mode, task)

    main = [r for r in rows if r["tools_json"] != "[]"]  # the agent loop; the rest is side traffic
    calls = [r for r in main if r["finish_reason"] == "tool_calls"]
    assert len(calls) == 1 + (name in FINISHES_BY_TOOL), [r["finish_reason"] for r in main]
    first = calls[0]
    shell_names = {t.name for t in HARNESSES[name].shell_tools}
    called = tiny_engine.tokenizer.decode(first["completion_ids"])
    assert any(f'"name": "{n}"' in called for n in shell_names), called
    # The follow-up request carries the tool result, and the engine then answers with the final text.
    follow = [r for r in main if r["seq"] > first["seq"] and any(m["role"] == "tool" for m in messages(r))]
    assert follow, [messages(r)[-1] for r in main]
    answer = tiny_engine.tokenizer.decode(follow[0]["completion_ids"], skip_special_tokens=True)
    if name in FINISHES_BY_TOOL:
        assert answer.startswith(FINAL) and FINISHES_BY_TOOL[name] in answer, answer
        assert follow[0]["finish_reason"] == "tool_calls" and len(rows) == 2, context
    else:
        assert answer == FINAL and follow[0]["finish_reason"] == "stop"
    if name in DROPS_LAST_MESSAGE:
        before, after = messages(first), messages(follow[0])
        assert after[: len(before) - 1] == before[:-1] and after[-1] == before[-1], after
        assert follow[0]["splice_reason"] == "no prefix match"  # a chain of its own (recipes/openclaw.md)
    else:
        # The harness re-sent its history so that it renders to the very same tokens (what prefix merging needs).
        assert follow[0]["prompt_ids"][: len(first["prompt_ids"])] == first["prompt_ids"]
    # Scripted tokens carry the model's true logprobs (a forward pass over the recorded ids agrees).
    scored = tiny_engine.score(first["prompt_ids"], first["completion_ids"])
    assert max(abs(a - b) for a, b in zip(scored, first["completion_logprobs"], strict=True)) < 1e-3
    if name in CHECKS:
        CHECKS[name]([first, follow[0]] if name != "gemini" else rows, mode)
