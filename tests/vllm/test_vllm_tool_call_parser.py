"""Qwen3-Coder's XML tool calls, sampled by a real vLLM (CPU build), parsed by the gateway on the token-in path
(issue 42 §2): vLLM returns the raw text there, and `polar_tool_call_parser=qwen3_coder` names the notation to a
gateway in front of a vLLM that was not started by `polar-mitm vllm serve --tool-call-parser` (the session's vLLM
was started with the default). vLLM plays the XML as a scripted turn with the model's own logprobs; the harness (the
openai SDK) gets a typed tool call, whole (a chain's first call: vLLM's chat endpoint, its text unparsed) and
streamed (the token-in path), and each record keeps the sampled ids of the XML text.
tests/engines/test_vllm_tool_call_parser.py checks the same parse against the dialect without a vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai import OpenAI

from polar_mitm.agent.sdk_agent import join_chat_stream
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.storage.records import read_all
from tests.vllm.conftest import VLLM_GATEWAY_OPTIONS

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": SCHEMA}}]
XML_CALL = (
    "Running it.\n<tool_call>\n<function=shell>\n<parameter=command>\nls\n</parameter>\n"
    "<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_coder_xml_sampled_by_vllm_is_a_typed_tool_call_through_the_gateway(
    vllm_url, vllm_script, tmp_path: Path
):
    options = {**VLLM_GATEWAY_OPTIONS, "polar_max_tokens": "96", "polar_tool_call_parser": "qwen3_coder"}
    with (
        gateway_processes.gateway_running(
            vllm_url,
            tmp_path / "flows",
            confdir=tmp_path / "conf",
            log=tmp_path / "gateway.log",
            options=options,
        ) as gateway,
        vllm_script({"turns": [XML_CALL]}),
    ):
        client = OpenAI(base_url=f"{gateway.reverse_url}/s/coder/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "List the files."}]
        whole = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        streamed = join_chat_stream(
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
        )
    message = whole.choices[0].message
    [call] = message.tool_calls
    assert call.function.name == "shell"
    assert json.loads(call.function.arguments) == {"command": "ls", "timeout": 30}  # typed by the schema
    assert (message.content or "").strip() == "Running it."
    content, [streamed_call] = streamed
    assert streamed_call["name"] == "shell" and json.loads(streamed_call["arguments"]) == {
        "command": "ls",
        "timeout": 30,
    }
    assert content.strip() == "Running it."
    rows = sorted(read_all(tmp_path / "flows").to_pylist(), key=lambda r: r["seq"])
    assert [r["finish_reason"] for r in rows] == ["tool_calls", "tool_calls"]
    # A chain's first call goes to vLLM's chat endpoint (it renders; its answer's text comes back unparsed), the
    # same prompt again takes the token-in path: the gateway's parser split both.
    assert [r["prompt_mode"] for r in rows] == ["messages", "tokens"] and all(
        r["completion_ids"] for r in rows
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        json.loads((tmp_path / "flows" / "_engine.json").read_text())["tokenizer_path"]
    )
    for row in rows:
        assert XML_CALL in tokenizer.decode(row["completion_ids"])  # what vLLM sampled: the XML itself
