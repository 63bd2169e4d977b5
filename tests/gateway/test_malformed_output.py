"""A small model's unparseable output, through each provider API and its official SDK (plain and streaming).

The scripted tiny engine writes what a real small model writes when it goes wrong — broken `<tool_call>` JSON,
an unclosed `<think>`, a tool the request never offered, arguments that are not an object, a call cut off
before `</tool_call>` — and the gateway must still give a well-formed answer the SDK parses: text, not a crash,
not a 500, not a call the harness cannot run. The record keeps the sampled ids as sampled and an honest finish
reason.
"""

from __future__ import annotations

import json
import uuid

import pytest

from polar_mitm.agent.sdk_agent import DRIVERS, base_url_for
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import read_all

# case → (what the model writes, what the harness must see as text)
CASES = {
    "broken-json": (
        '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"\n</tool_call>',
        '{"name": "shell", "arguments": {"command": "ls"',
    ),
    "unclosed-think": ("<think>\nI should list the files first", "I should list the files first"),
    "unknown-tool": (
        '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',
        '"name": "delete_everything"',
    ),
    "array-arguments": (
        '<tool_call>\n{"name": "shell", "arguments": [1, 2]}\n</tool_call>',
        '"arguments": [1, 2]',
    ),
    "unterminated-call": (
        'Let me look.\n<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}',
        "Let me look.",
    ),
}
SCRIPT = {
    "turns": ["unused"],
    "replies": [{"when": f"case:{name}", "text": text} for name, (text, _) in CASES.items()],
}


@pytest.fixture(scope="module")
def malformed_gateway(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("malformed")
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with gateway_processes.engine_and_gateway(
        root / "flows",
        confdir=root / "conf",
        engine_args=["--script", str(script)],
        engine_log=root / "engine.log",
        gateway_log=root / "gateway.log",
    ) as (_, gw):
        yield gw


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("provider", list(DRIVERS))
@pytest.mark.parametrize("case", list(CASES))
def test_malformed_model_output_reaches_the_sdk_as_text(
    malformed_gateway, tiny_engine, case, provider, stream
):
    session = f"bad-{case}-{provider}-{uuid.uuid4().hex[:6]}"
    base = base_url_for(provider, malformed_gateway.reverse_url, SessionId(session).path_prefix)
    result = DRIVERS[provider](f"case:{case}", api_key="sk-test", base_url=base, stream=stream, max_turns=1)
    written, shown = CASES[case]
    assert result.tool_commands == [] and result.calls == 1  # no call the harness would try to run
    assert shown in result.final_text

    rows = [r for r in read_all(malformed_gateway.out_dir).to_pylist() if r["session_id"] == session]
    assert len(rows) == 1
    row = rows[0]
    assert row["status_code"] == 200 and row["error"] is None
    assert row["finish_reason"] == "stop"  # the model ended its turn; no tool call was made
    # The sampled ids are exactly what the model wrote, end-of-turn included, with a logprob each.
    tok = tiny_engine.tokenizer
    assert tok.decode(row["completion_ids"][:-1]) == written
    assert row["completion_ids"][-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert len(row["completion_logprobs"]) == len(row["completion_ids"])


# -- the two layers on their own: the engine's parser, and the gateway's guard for answers from SGLang ---------


def test_engine_parser_keeps_unrunnable_calls_as_text():
    from polar_mitm.engine.parsers import parse_output

    text = (
        '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    )
    parsed = parse_output(
        text, tool_call_parser="qwen25", reasoning_parser="qwen3", tools_given=True, offered=["shell"]
    )
    assert [c.name for c in parsed.tool_calls] == ["shell"]
    assert '"name": "nope"' in parsed.content


def test_gateway_turns_an_engines_unknown_tool_call_into_text():
    from polar_mitm.conversation import Completion, ToolCall, harness_safe

    # SGLang with SGLANG_FORWARD_UNKNOWN_TOOLS passes calls of tools the request never offered.
    completion = Completion(
        id="x",
        model="m",
        content="",
        reasoning=None,
        finish_reason="tool_calls",
        tool_calls=[ToolCall("c1", "rm_rf", "{}"), ToolCall("c2", "shell", "[1]")],
        prompt_ids=[1],
        completion_ids=[2, 3],
        completion_logprobs=[-0.1, -0.2],
    )
    harness_safe(completion, ["shell"])
    assert completion.tool_calls == [] and completion.finish_reason == "stop"
    assert '"name": "rm_rf"' in completion.content and '"arguments": [1]' in completion.content
    assert completion.completion_ids == [2, 3]  # what was sampled is never touched
