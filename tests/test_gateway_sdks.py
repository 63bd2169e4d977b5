"""The official SDKs through the real gateway (mitmdump + addon) in both hook-up modes, plain and streaming.

Each case is a two-turn, tool-using exchange against the scripted tiny engine: turn 1 the model calls `shell`,
turn 2 (after the tool result) it answers. Then the records are checked against what the client received.
"""

from __future__ import annotations

import json
import uuid

import anthropic
import openai
import pytest
from google import genai
from google.genai import types as gtypes

from polar_mitm.records import read_all

API_KEY = "sk-polar-test-SECRET-7f3a9c"
USER_TEXT = "Write hello into out.txt"
FINAL_TEXT = "Done: out.txt now says hello."
SHELL_ARGS = {"command": "echo hello > out.txt"}
SHELL_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


def base(gateway, mode: str, session: str, task: str, suffix: str = "") -> str | None:
    return f"{gateway.reverse_url}/t/{task}/s/{session}{suffix}" if mode == "reverse" else None


def run_anthropic(gateway, mode, session, task, stream):
    client = anthropic.Anthropic(api_key=API_KEY, base_url=base(gateway, mode, session, task), max_retries=0)
    tools = [{"name": "shell", "description": "Run a shell command", "input_schema": SHELL_SCHEMA}]
    messages = [{"role": "user", "content": USER_TEXT}]

    def ask(msgs):
        kwargs = dict(model="claude-sonnet-4-5", max_tokens=256, messages=msgs, tools=tools,
                      system="You are a coding agent.")
        if stream:
            with client.messages.stream(**kwargs) as s:
                return s.get_final_message()
        return client.messages.create(**kwargs)

    first = ask(messages)
    call = next(b for b in first.content if b.type == "tool_use")
    assert first.stop_reason == "tool_use" and call.name == "shell" and call.input == SHELL_ARGS
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "ok"}]}]
    second = ask(messages)
    assert second.stop_reason == "end_turn"
    return "".join(b.text for b in second.content if b.type == "text")


def run_openai_chat(gateway, mode, session, task, stream):
    client = openai.OpenAI(api_key=API_KEY, base_url=base(gateway, mode, session, task, "/v1"), max_retries=0)
    tools = [{"type": "function", "function": {"name": "shell", "description": "Run a shell command",
                                               "parameters": SHELL_SCHEMA}}]
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": USER_TEXT}]

    def ask(msgs):
        if not stream:
            return client.chat.completions.create(model="gpt-4.1", messages=msgs, tools=tools).choices[0].message
        content, calls = "", {}
        for chunk in client.chat.completions.create(model="gpt-4.1", messages=msgs, tools=tools, stream=True,
                                                    stream_options={"include_usage": True}):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
        return openai.types.chat.ChatCompletionMessage(role="assistant", content=content or None, tool_calls=[
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()] or None)

    first = ask(messages)
    call = first.tool_calls[0]
    assert call.function.name == "shell" and json.loads(call.function.arguments) == SHELL_ARGS
    messages += [first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
    return ask(messages).content


def run_openai_responses(gateway, mode, session, task, stream):
    client = openai.OpenAI(api_key=API_KEY, base_url=base(gateway, mode, session, task, "/v1"), max_retries=0)
    tools = [{"type": "function", "name": "shell", "description": "Run a shell command", "parameters": SHELL_SCHEMA,
              "strict": False}]
    items: list = [{"role": "user", "content": USER_TEXT}]

    def ask(inp):
        kwargs = dict(model="gpt-5-codex", input=inp, tools=tools, instructions="You are a coding agent.",
                      store=False)
        if stream:
            with client.responses.stream(**kwargs) as s:
                return s.get_final_response()
        return client.responses.create(**kwargs)

    first = ask(items)
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "shell" and json.loads(call.arguments) == SHELL_ARGS
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "ok"})
    return ask(items).output_text


def run_google(gateway, mode, session, task, stream):
    options = gtypes.HttpOptions(base_url=base(gateway, mode, session, task)) if mode == "reverse" else None
    client = genai.Client(api_key=API_KEY, http_options=options)
    tool = gtypes.Tool(function_declarations=[gtypes.FunctionDeclaration(
        name="shell", description="Run a shell command", parameters_json_schema=SHELL_SCHEMA)])
    config = gtypes.GenerateContentConfig(
        tools=[tool], system_instruction="You are a coding agent.",
        automatic_function_calling=gtypes.AutomaticFunctionCallingConfig(disable=True))
    contents = [gtypes.Content(role="user", parts=[gtypes.Part(text=USER_TEXT)])]

    def ask(cont):
        if not stream:
            resp = client.models.generate_content(model="gemini-2.5-flash", contents=cont, config=config)
            return resp.candidates[0].content.parts, resp.candidates[0].finish_reason
        parts, finish = [], None
        for chunk in client.models.generate_content_stream(model="gemini-2.5-flash", contents=cont, config=config):
            if chunk.candidates and chunk.candidates[0].content and chunk.candidates[0].content.parts:
                parts += chunk.candidates[0].content.parts
            if chunk.candidates and chunk.candidates[0].finish_reason:
                finish = chunk.candidates[0].finish_reason
        return parts, finish

    parts, finish = ask(contents)
    call = next(p.function_call for p in parts if p.function_call)
    assert call.name == "shell" and call.args == SHELL_ARGS and finish == gtypes.FinishReason.STOP
    contents += [gtypes.Content(role="model", parts=parts), gtypes.Content(role="user", parts=[
        gtypes.Part.from_function_response(name="shell", response={"output": "ok"})])]
    parts, _ = ask(contents)
    return "".join(p.text or "" for p in parts if not p.thought)


RUNNERS = {"anthropic": run_anthropic, "openai_chat": run_openai_chat, "openai_responses": run_openai_responses,
           "google": run_google}


def session_records(gateway, session):
    table = read_all(gateway.out_dir)
    rows = [r for r in table.to_pylist() if r["session_id"] == session]
    return sorted(rows, key=lambda r: r["seq"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("mode", ["proxy", "reverse"])
@pytest.mark.parametrize("provider", list(RUNNERS))
def test_sdk_two_turn_tool_session_is_answered_and_recorded(gateway, proxy_env, tiny_engine, provider, mode,
                                                            stream):
    session, task = f"{provider}-{mode}-{uuid.uuid4().hex[:8]}", f"task-{provider}"
    if mode == "proxy":
        proxy_env(session, task)
    final_text = RUNNERS[provider](gateway, mode, session, task, stream)
    assert final_text.strip() == FINAL_TEXT

    rows = session_records(gateway, session)
    assert [r["seq"] for r in rows] == [0, 1]
    tok = tiny_engine.tokenizer
    for r in rows:
        assert r["provider"] == provider and r["stream"] is stream and r["task_id"] == task
        assert r["session_source"] == ("proxy_auth" if mode == "proxy" else "path")
        assert r["mode"] == ("regular" if mode == "proxy" else "reverse")
        assert r["error"] is None and r["status_code"] == 200
        assert len(r["completion_logprobs"]) == len(r["completion_ids"]) > 0
        assert all(lp <= 0 for lp in r["completion_logprobs"])
        assert r["prompt_tokens"] == len(r["prompt_ids"]) and r["weight_version"] is not None
        assert r["model_used"] == "tiny" and r["model_requested"]
    first, second = rows
    assert first["finish_reason"] == "tool_calls" and second["finish_reason"] == "stop"
    assert '"name": "shell"' in tok.decode(first["completion_ids"])
    assert tok.decode(second["completion_ids"], skip_special_tokens=True) == final_text
    # The follow-up carries the tool result, and the first prompt is an exact token prefix of the second.
    assert any(m["role"] == "tool" for m in json.loads(second["messages_json"]))
    assert second["prompt_ids"][: len(first["prompt_ids"])] == first["prompt_ids"]
    assert json.loads(first["tools_json"])[0]["name"] == "shell"


def test_no_secret_reaches_records_or_logs(gateway, proxy_env):
    proxy_env("secret-check")
    run_openai_chat(gateway, "proxy", "secret-check", None, False)
    run_anthropic(gateway, "reverse", "secret-check-2", "t", True)
    table = read_all(gateway.out_dir)
    for column in table.column_names:
        if str(table.schema.field(column).type) == "string":
            assert not any(API_KEY in (v or "") for v in table[column].to_pylist()), column
    assert API_KEY not in gateway.log.read_text()
