"""The tool-call parser registry (`engine/tool_call_formats.py`): hermes/qwen25 JSON and Qwen3-Coder's XML.

Real model text through the registry, whole and streamed; then the embedded engine started with `--tool-call-parser
qwen3_coder` and a scripted policy writing Qwen3-Coder's notation, through the gateway, to the official openai SDK:
the client gets `tool_calls` whose arguments carry the JSON types of the request's schema, while the record keeps
exactly the sampled ids. A malformed call reaches the client as text, as a malformed JSON call does.
"""

from __future__ import annotations

import json
import uuid

import pytest

from polar_mitm.engine.parsers import TextStreamParser, parse_output
from polar_mitm.engine.tool_call_formats import (
    TOOL_CALL_FORMATS,
    UnknownToolCallParser,
    tool_call_format,
    tool_parameters,
)

EDIT_SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "line": {"type": "integer"},
        "dry_run": {"type": "boolean"},
        "ratio": {"type": "number"},
        "options": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "note": {"type": ["string", "null"]},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    },
    "required": ["path"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "edit", "description": "Edit a file", "parameters": EDIT_SCHEMA},
    },
    {"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}},
]
OFFERED = tool_parameters(TOOLS)

# As Qwen3-Coder's chat template writes a call: a newline around each value; Python's `False` and `None`; a value
# holding `</parameter>` itself (code) and spanning lines.
XML_CALL = """I'll make the change.
<tool_call>
<function=edit>
<parameter=path>
src/app.py
</parameter>
<parameter=line>
42
</parameter>
<parameter=dry_run>
False
</parameter>
<parameter=ratio>
0.25
</parameter>
<parameter=options>
{"indent": 4, "fix": [true]}
</parameter>
<parameter=tags>
['a', 'b']
</parameter>
<parameter=note>
def f():
    return "</parameter>"
</parameter>
<parameter=limit>
None
</parameter>
</function>
</tool_call>"""
XML_ARGUMENTS = {
    "path": "src/app.py",
    "line": 42,
    "dry_run": False,
    "ratio": 0.25,
    "options": {"indent": 4, "fix": [True]},
    "tags": ["a", "b"],
    "note": 'def f():\n    return "</parameter>"',
    "limit": None,
}
JSON_CALL = 'Looking.\n<tool_call>\n{"name": "edit", "arguments": {"path": "a.py", "line": 3}}\n</tool_call>'


def parsed(text: str, parser: str, offered=OFFERED):
    return parse_output(
        text, tool_call_parser=parser, reasoning_parser="qwen3", tools_given=True, offered=offered
    )


def test_a_qwen3_coder_call_carries_the_json_types_of_the_tools_schema():
    out = parsed(XML_CALL, "qwen3_coder")
    assert out.content == "I'll make the change."
    assert [c.name for c in out.tool_calls] == ["edit"]
    assert json.loads(out.tool_calls[0].arguments) == XML_ARGUMENTS
    assert isinstance(json.loads(out.tool_calls[0].arguments)["line"], int)


def test_each_parser_reads_its_own_notation_only():
    for name in ("hermes", "qwen25"):
        out = parsed(JSON_CALL, name)
        assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
            ("edit", {"path": "a.py", "line": 3})
        ]
        assert parsed(XML_CALL, name).tool_calls == []  # XML is not JSON: stays text
    assert parsed(JSON_CALL, "qwen3_coder").tool_calls == []
    assert parsed(XML_CALL, "none").content == XML_CALL
    assert set(TOOL_CALL_FORMATS) == {"hermes", "qwen25", "qwen3_coder"}


def test_without_schemas_or_declared_parameters_the_values_stay_text():
    call = "<tool_call>\n<function=free>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>"
    assert json.loads(parsed(call, "qwen3_coder").tool_calls[0].arguments) == {"count": "3"}  # no properties
    by_name = parsed(XML_CALL, "qwen3_coder", offered=["edit"]).tool_calls[0]  # names only: no types known
    assert json.loads(by_name.arguments)["line"] == "42"
    # A value that does not convert to its declared type is kept as written (the harness answers the model).
    wrong = XML_CALL.replace("42", "forty-two").replace("False", "maybe")
    arguments = json.loads(parsed(wrong, "qwen3_coder").tool_calls[0].arguments)
    assert arguments["line"] == "forty-two" and arguments["dry_run"] == "maybe"


def _strip(tag: str) -> str:
    return XML_CALL.replace(tag, "")


MALFORMED = {
    "unterminated-function": _strip("</function>\n"),
    "unterminated-parameter": XML_CALL.replace("0.25\n</parameter>", "0.25\n"),
    "unknown-parameter": XML_CALL.replace("<parameter=ratio>", "<parameter=speed>"),
    "unknown-tool": XML_CALL.replace("<function=edit>", "<function=delete_everything>"),
    "text-between-parameters": XML_CALL.replace(
        "</parameter>\n<parameter=line>", "</parameter>\nhmm\n<parameter=line>"
    ),
    "repeated-parameter": XML_CALL.replace("<parameter=ratio>", "<parameter=line>"),
    "no-function": "Let me see.\n<tool_call>\n<parameter=path>\nx\n</parameter>\n</tool_call>",
    "unterminated-tool-call": XML_CALL.removesuffix("</tool_call>"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_qwen3_coder_call_stays_text_whole_and_streamed(case):
    text = MALFORMED[case]
    out = parsed(text, "qwen3_coder")
    assert out.tool_calls == [] and out.content == text
    streamed = stream_pieces(text, "qwen3_coder", size=7)
    assert [p for p in streamed if p[0] == "tool_call"] == []
    assert "".join(str(v) for k, v in streamed if k == "content") == text


def stream_pieces(text: str, parser: str, size: int) -> list[tuple[str, object]]:
    stream = TextStreamParser(
        tool_call_parser=parser, reasoning_parser="qwen3", tools_given=True, offered=OFFERED
    )
    pieces = [p for i in range(0, len(text), size) for p in stream.feed(text[i : i + size])]
    return pieces + stream.feed("", final=True)


@pytest.mark.parametrize("size", [1, 5, 64])
def test_streamed_pieces_add_up_to_the_whole_parse(size):
    text = (
        "<think>\nEdit it.\n</think>\n\n"
        + XML_CALL
        + "\n"
        + JSON_CALL.split("Looking.\n")[1].replace('"edit"', '"free"')
    )
    whole = parsed(text, "qwen3_coder")
    pieces = stream_pieces(text, "qwen3_coder", size)
    calls = [p[1] for p in pieces if p[0] == "tool_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("edit", XML_ARGUMENTS)]
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("edit", XML_ARGUMENTS)]
    assert "".join(str(v) for k, v in pieces if k == "content") == whole.content  # the JSON block: text here
    assert "".join(str(v) for k, v in pieces if k == "reasoning") == whole.reasoning == "Edit it."


def test_an_unknown_parser_name_is_one_line_and_exit_2_before_the_model_loads(capsys):
    from polar_mitm.cli import main

    with pytest.raises(UnknownToolCallParser, match="qwen3_coder"):
        tool_call_format("qwen3-coder")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--tool-call-parser", "qwen3-coder"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(err) == 1
    assert "unknown tool-call parser 'qwen3-coder'" in err[0] and "qwen3_coder" in err[0]


# -- through a real engine, the gateway and the openai SDK --------------------------------------------------------

SHELL_SCHEMA = {
    "type": "object",
    "properties": {
        "command": {"type": "string"},
        "timeout": {"type": "integer"},
        "background": {"type": "boolean"},
    },
    "required": ["command"],
}
SHELL_TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": SHELL_SCHEMA}}]
TYPED_CALL = (
    "Listing the files.\n<tool_call>\n<function=shell>\n<parameter=command>\nls -la\n</parameter>\n"
    "<parameter=timeout>\n30\n</parameter>\n<parameter=background>\nfalse\n</parameter>\n</function>\n</tool_call>"
)
UNCLOSED_CALL = (
    "Listing the files.\n<tool_call>\n<function=shell>\n<parameter=command>\nls -la\n</parameter>\n"
)
SCRIPT = {
    "turns": ["unused"],
    "replies": [
        {"when": "case:typed-call", "text": TYPED_CALL},
        {"when": "case:unclosed-function", "text": UNCLOSED_CALL},
    ],
}


@pytest.fixture(scope="module")
def coder_gateway(tiny_model_dir, tmp_path_factory):
    from polar_mitm.gateway import processes as gateway_processes

    root = tmp_path_factory.mktemp("qwen3-coder")
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with gateway_processes.engine_and_gateway(
        root / "flows",
        confdir=root / "conf",
        engine_args=["--script", str(script), "--tool-call-parser", "qwen3_coder"],
        engine_log=root / "engine.log",
        gateway_log=root / "gateway.log",
    ) as (_, gw):
        yield gw


def ask(gw, case: str, stream: bool) -> tuple[str, str | None, list[tuple[str, dict]], str]:
    """(session, text, calls, finish reason) of one openai SDK chat call through the gateway."""
    import openai

    from polar_mitm.agent.sdk_agent import base_url_for, join_chat_stream
    from polar_mitm.session_ids import SessionId

    session = f"coder-{case}-{uuid.uuid4().hex[:6]}"
    base = base_url_for("openai_chat", gw.reverse_url, SessionId(session).path_prefix)
    client = openai.OpenAI(api_key="sk-test", base_url=base, max_retries=0)
    request = dict(model="gpt-4.1", messages=[{"role": "user", "content": f"case:{case}"}], tools=SHELL_TOOLS)
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))
        text, joined = join_chat_stream(chunks)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        return session, text, [(c["name"], json.loads(c["arguments"])) for c in joined], finish
    choice = client.chat.completions.create(**request).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    return session, choice.message.content, calls, choice.finish_reason


def record_of(gw, session: str) -> dict:
    from polar_mitm.storage.records import read_all

    rows = [r for r in read_all(gw.out_dir).to_pylist() if r["session_id"] == session]
    assert len(rows) == 1
    return rows[0]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_openai_sdk_gets_a_qwen3_coder_call_with_typed_arguments(coder_gateway, tiny_engine, stream):
    session, text, calls, finish = ask(coder_gateway, "typed-call", stream)
    assert calls == [("shell", {"command": "ls -la", "timeout": 30, "background": False})]
    assert (text or "").strip() == "Listing the files." and finish == "tool_calls"
    row = record_of(coder_gateway, session)
    assert row["finish_reason"] == "tool_calls"
    # Parsing shaped the message only: the record holds the ids as sampled, end-of-turn included.
    tok = tiny_engine.tokenizer
    assert row["completion_ids"] == tok.encode(TYPED_CALL, add_special_tokens=False) + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    assert len(row["completion_logprobs"]) == len(row["completion_ids"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_unclosed_qwen3_coder_function_reaches_the_sdk_as_text(coder_gateway, tiny_engine, stream):
    session, text, calls, finish = ask(coder_gateway, "unclosed-function", stream)
    assert calls == [] and finish == "stop"
    assert "<function=shell>" in (text or "") and "Listing the files." in (text or "")
    row = record_of(coder_gateway, session)
    assert row["finish_reason"] == "stop"
    assert tiny_engine.tokenizer.decode(row["completion_ids"][:-1]) == UNCLOSED_CALL
