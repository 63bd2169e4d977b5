"""The scripted policy (engine/script.py): turns chosen by history, tool names chosen by the request's tools."""

from __future__ import annotations

import json

import pytest

from polar_mitm.engine.script import Script, ScriptError, turn_text
from polar_mitm.harness.policy import HELLO_SCRIPT

ADAPTIVE = {
    "turns": [
        {
            "text": "On it.",
            "tool_call": {
                "name": ["Bash", "exec_command", "bash"],
                "arguments": {"command": "ls"},
                "arguments_by_name": {"exec_command": {"cmd": "ls"}},
            },
        },
        "All done.",
    ],
    "side": "A title",
    "replies": [{"when": "Complexity Score", "text": '{"complexity_score": 10}'}],
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def prompt(tokenizer, messages, tools=None):
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def script(tokenizer, spec=ADAPTIVE) -> Script:
    return Script(spec, tokenizer, tokenizer.eos_token_id)


def call_of(text: str) -> dict:
    return json.loads(text.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0])


USER = [{"role": "user", "content": "list files"}]


def test_first_offered_candidate_is_called_with_its_own_argument_shape(tokenizer):
    s = script(tokenizer)
    ids = prompt(tokenizer, USER)
    assert call_of(s.text_for(ids, ["Read", "exec_command", "bash"])) == {
        "name": "exec_command",
        "arguments": {"cmd": "ls"},
    }
    assert call_of(s.text_for(ids, ["bash"])) == {"name": "bash", "arguments": {"command": "ls"}}
    assert s.text_for(ids, ["bash"]).startswith("On it.\n<tool_call>")
    assert s.ids_for(ids, ["bash"])[-1] == tokenizer.eos_token_id


def test_unknown_tools_take_the_first_candidate_and_no_candidate_gets_the_side_text(tokenizer):
    s = script(tokenizer)
    ids = prompt(tokenizer, USER)
    assert call_of(s.text_for(ids, None))["name"] == "Bash"  # /generate: tools unknown
    assert s.text_for(ids, ["Read", "Write"]) == "A title"  # e.g. a sub-agent without a shell


def test_side_requests_never_get_a_tool_call(tokenizer):
    s = script(tokenizer)
    assert s.text_for(prompt(tokenizer, USER), []) == "A title"
    no_side = script(tokenizer, {**ADAPTIVE, "side": None})
    assert no_side.text_for(prompt(tokenizer, USER), []) == "On it."


def test_replies_match_the_prompt_text(tokenizer):
    s = script(tokenizer)
    router = [{"role": "system", "content": "Assign a **Complexity Score** from 1 to 100."}, *USER]
    assert s.text_for(prompt(tokenizer, router), []) == '{"complexity_score": 10}'


def test_turn_follows_the_number_of_assistant_turns_in_the_history(tokenizer):
    s = script(tokenizer)
    history = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    ]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    assert s.turn_index(prompt(tokenizer, history, tools)) == 1
    assert s.text_for(prompt(tokenizer, history, tools), ["bash"]) == "All done."


def test_plain_list_scripts_and_string_names_keep_working(tokenizer):
    s = script(tokenizer, [{"tool_call": {"name": "shell", "arguments": {"command": "ls"}}}, "ok"])
    ids = prompt(tokenizer, USER)
    assert call_of(s.text_for(ids, ["bash"])) == {"name": "shell", "arguments": {"command": "ls"}}
    assert (
        turn_text({"tool_call": {"name": ["a", "b"]}}, ["b"])
        == '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    )


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"turns": []},
        [{"tool_call": {"arguments": {}}}],
        [{"tool_call": {"name": []}}],
        [42],
        {"turns": ["x"], "replies": [{"when": "y"}]},
    ],
)
def test_malformed_scripts_are_refused(tokenizer, bad):
    with pytest.raises(ScriptError):
        script(tokenizer, bad)


def test_harness_policy_covers_every_harness_shell_tool(tokenizer):
    from polar_mitm.harness import HARNESSES

    s = script(tokenizer, HELLO_SCRIPT)
    ids = prompt(tokenizer, USER)
    for harness in (h for h in HARNESSES.values() if h.shell_tools):  # Aider has none (an edit format)
        tool = harness.shell_tools[0]
        call = call_of(s.text_for(ids, [tool.name]))
        assert call["name"] == tool.name
        assert tool.call("echo hello > out.txt").items() <= call["arguments"].items()
