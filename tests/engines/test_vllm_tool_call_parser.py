"""The tool-call parser on vLLM without a vLLM: `polar-mitm vllm serve --tool-call-parser` names it to vLLM and,
through `--additional-config`, to the gateway's vLLM dialect, which parses the token-in path's raw text (whole and
streamed) with it — here Qwen3-Coder's XML, typed by the request's tool schema. A real vLLM run of this path is
left to the vLLM suite (tests/vllm/).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import orjson
import pytest

from polar_mitm.conversation import Completion
from polar_mitm.engines.dialects.vllm import VllmStream, sglang_answer, to_vllm, vllm_model_info
from polar_mitm.engines.stream import StreamAssembler

PROMPT = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": SCHEMA}}]
XML_CALL = (
    "Running it.\n<tool_call>\n<function=shell>\n<parameter=command>\nls\n</parameter>\n"
    "<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>"
)
MODELS = {"data": [{"id": "coder", "root": "/models/coder", "max_model_len": 8192}]}


def served_info(additional_config: dict | None) -> dict:
    config = {"model_config": {"logprobs_mode": "processed_logprobs"}}
    if additional_config is not None:
        config["additional_config"] = additional_config
    return vllm_model_info(MODELS, "0", {"vllm_config": config}, "0.32.0")


def token_in_request(**extra) -> dict:
    return {"model": "default", "input_ids": PROMPT, "tools": TOOLS, "logprobs": True, **extra}


def test_vllm_serve_names_the_parser_to_vllm_and_in_its_additional_config(monkeypatch):
    from polar_mitm.engine.tool_call_formats import TOOL_CALL_FORMATS
    from polar_mitm.vllm.server import VLLM_TOOL_CALL_PARSERS, vllm_command

    monkeypatch.setenv("POLAR_VLLM_PYTHON", sys.executable)  # the command line only: nothing is started
    cmd = vllm_command(Path("/models/coder"), port=1, tool_call_parser="qwen3_coder")
    assert cmd[cmd.index("--tool-call-parser") + 1] == "qwen3_coder" and "--enable-auto-tool-choice" in cmd
    said = json.loads(cmd[cmd.index("--additional-config") + 1])
    assert served_info(said)["tool_call_parser"] == "qwen3_coder"  # what the dialect reads back
    default = vllm_command(Path("/models/coder"), port=1)
    assert (
        default[default.index("--tool-call-parser") + 1] == "hermes" and "--additional-config" not in default
    )
    none = vllm_command(Path("/models/coder"), port=1, tool_call_parser="none")
    assert "--tool-call-parser" not in none
    assert served_info(json.loads(none[none.index("--additional-config") + 1]))["tool_call_parser"] == "none"
    assert set(VLLM_TOOL_CALL_PARSERS) == set(TOOL_CALL_FORMATS)  # every notation has vLLM's name


def test_a_vllm_that_names_no_parser_gets_the_json_one():
    assert served_info(None)["tool_call_parser"] == "qwen25"
    assert vllm_model_info(MODELS, None, None, "0.32.0")["tool_call_parser"] == "qwen25"  # no dev mode


def test_a_token_in_answer_in_qwen3_coder_xml_becomes_a_typed_call():
    call = to_vllm(token_in_request(), served_info({"polar_tool_call_parser": "qwen3_coder"}))
    ids = list(range(1000, 1030)) + [151645]
    answer = {
        "id": "cmpl-1",
        "model": "coder",
        "choices": [
            {
                "index": 0,
                "text": XML_CALL,
                "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                "finish_reason": "stop",
                "token_ids": ids,
                "prompt_token_ids": PROMPT,
            }
        ],
    }
    completion = Completion.from_engine_response(sglang_answer(call, answer, "3"))
    assert completion.finish_reason == "tool_calls" and completion.content == "Running it."
    assert [(c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [
        ("shell", {"command": "ls", "timeout": 30})
    ]
    assert completion.completion_ids == ids  # the sampled ids, untouched by the parse


@pytest.mark.parametrize("parser", ["qwen3_coder", "qwen25"])
def test_a_streamed_token_in_answer_is_parsed_with_the_served_parser(parser):
    call = to_vllm(token_in_request(stream=True), served_info({"polar_tool_call_parser": parser}))
    pieces = [XML_CALL[i : i + 6] for i in range(0, len(XML_CALL), 6)]
    chunks = [
        {
            "id": "cmpl-1",
            "model": "coder",
            "choices": [
                {
                    "index": 0,
                    "text": piece,
                    "logprobs": {"token_logprobs": [-0.25]},
                    "finish_reason": "stop" if i == len(pieces) - 1 else None,
                    "token_ids": [2000 + i],
                    "prompt_token_ids": PROMPT if i == 0 else None,
                }
            ],
        }
        for i, piece in enumerate(pieces)
    ]
    translator, assembler = VllmStream(call), StreamAssembler()
    for chunk in chunks:
        for translated in translator.feed(orjson.loads(orjson.dumps(chunk))):
            assembler.feed(translated)
    for translated in translator.finish():
        assembler.feed(translated)
    assembler.finish()
    completion = assembler.completion()
    assert completion.completion_ids == [2000 + i for i in range(len(pieces))]
    if parser == "qwen3_coder":
        assert [(c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [
            ("shell", {"command": "ls", "timeout": 30})
        ]
    else:  # the JSON parser on XML text: no call, the text as written
        assert completion.tool_calls == [] and completion.content == XML_CALL
