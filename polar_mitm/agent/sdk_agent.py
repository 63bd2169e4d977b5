"""A minimal reference agent on the official SDKs (anthropic, openai chat + responses, google-genai).

Each driver loops like a tiny coding agent: ask the model with a `shell` tool; while it calls the tool, run it
(`run_tool`) and send back the result; return the final text and the number of model calls. `base_url=None` means
"the provider's real host", i.e. HTTPS_PROXY mode when the environment points at the gateway.

Used by the tests, by `scripts/record_sample_flows.py`, and as the built-in `sdk:<provider>` harness of
`polar-mitm rollout` / `polar-mitm agent` (which runs commands for real in the workspace).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from polar_mitm.codecs import sdk_base_url

SHELL_TOOL_NAME = "shell"  # the one tool every provider's agent offers (scripted policies call it)
SHELL_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
SYSTEM = "You are a coding agent."


@dataclass
class SessionResult:
    final_text: str
    calls: int
    tool_commands: list[str]


def tool_output(args: dict) -> str:
    """The default tool: pretend to run the command (recording and tests need no side effects)."""
    return f"ran: {args.get('command', '')}"


ToolRunner = Callable[[dict], str]


def _ask(api: Any, stream: bool, final: Callable[[Any], Any], **kwargs: Any) -> Any:
    """One call of an SDK resource (`client.messages`, `client.responses`): its stream helper read to the end
    (`final` takes the finished object from it), or a plain `create`."""
    if stream:
        with api.stream(**kwargs) as events:
            return final(events)
    return api.create(**kwargs)


def anthropic_session(
    prompt: str,
    *,
    api_key: str,
    base_url: str | None,
    stream: bool,
    max_turns: int = 4,
    run_tool: ToolRunner = tool_output,
) -> SessionResult:
    import anthropic

    client = anthropic.Anthropic(api_key=api_key, base_url=base_url, max_retries=0)
    tools = [{"name": SHELL_TOOL_NAME, "description": "Run a shell command", "input_schema": SHELL_SCHEMA}]
    messages: list = [{"role": "user", "content": prompt}]
    commands: list[str] = []
    for turn in range(1, max_turns + 1):
        msg = _ask(
            client.messages,
            stream,
            lambda events: events.get_final_message(),
            model="claude-sonnet-4-6",
            max_tokens=256,
            messages=messages,
            tools=tools,
            system=SYSTEM,
        )
        calls = [b for b in msg.content if b.type == "tool_use"]
        if not calls:
            return SessionResult("".join(b.text for b in msg.content if b.type == "text"), turn, commands)
        commands += [c.input.get("command", "") for c in calls]
        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": c.id, "content": run_tool(c.input)} for c in calls
                ],
            },
        ]
    return SessionResult("", max_turns, commands)


def join_chat_stream(chunks: Iterable[Any]) -> tuple[str, list[dict[str, str]]]:
    """A streamed Chat Completions answer put back together: its text and its tool calls (id, name, arguments)."""
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
    return content, list(calls.values())


def openai_chat_session(
    prompt: str,
    *,
    api_key: str,
    base_url: str | None,
    stream: bool,
    max_turns: int = 4,
    run_tool: ToolRunner = tool_output,
) -> SessionResult:
    import openai

    client = openai.OpenAI(api_key=api_key, base_url=base_url, max_retries=0)
    tools = [
        {
            "type": "function",
            "function": {
                "name": SHELL_TOOL_NAME,
                "description": "Run a shell command",
                "parameters": SHELL_SCHEMA,
            },
        }
    ]
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    commands: list[str] = []
    for turn in range(1, max_turns + 1):
        if stream:
            content, calls = join_chat_stream(
                client.chat.completions.create(
                    model="gpt-4.1",
                    messages=messages,
                    tools=tools,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            message = openai.types.chat.ChatCompletionMessage(
                role="assistant",
                content=content or None,
                tool_calls=[
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls
                ]
                or None,
            )
        else:
            message = (
                client.chat.completions.create(model="gpt-4.1", messages=messages, tools=tools)
                .choices[0]
                .message
            )
        if not message.tool_calls:
            return SessionResult(message.content or "", turn, commands)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            commands.append(args.get("command", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(args)})
    return SessionResult("", max_turns, commands)


def openai_responses_session(
    prompt: str,
    *,
    api_key: str,
    base_url: str | None,
    stream: bool,
    max_turns: int = 4,
    run_tool: ToolRunner = tool_output,
) -> SessionResult:
    import openai

    client = openai.OpenAI(api_key=api_key, base_url=base_url, max_retries=0)
    tools = [
        {
            "type": "function",
            "name": SHELL_TOOL_NAME,
            "description": "Run a shell command",
            "parameters": SHELL_SCHEMA,
            "strict": False,
        }
    ]
    items: list = [{"role": "user", "content": prompt}]
    commands: list[str] = []
    for turn in range(1, max_turns + 1):
        resp = _ask(
            client.responses,
            stream,
            lambda events: events.get_final_response(),
            model="gpt-5-codex",
            input=items,
            tools=tools,
            instructions=SYSTEM,
            store=False,
        )
        calls = [o for o in resp.output if o.type == "function_call"]
        if not calls:
            return SessionResult(resp.output_text, turn, commands)
        items += [o.model_dump(exclude_none=True) for o in resp.output]
        for call in calls:
            args = json.loads(call.arguments or "{}")
            commands.append(args.get("command", ""))
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": run_tool(args)})
    return SessionResult("", max_turns, commands)


def google_session(
    prompt: str,
    *,
    api_key: str,
    base_url: str | None,
    stream: bool,
    max_turns: int = 4,
    run_tool: ToolRunner = tool_output,
) -> SessionResult:
    from google import genai
    from google.genai import types

    client = genai.Client(
        api_key=api_key, http_options=types.HttpOptions(base_url=base_url) if base_url else None
    )
    tool = types.Tool(
        function_declarations=[
            types.FunctionDeclaration(
                name=SHELL_TOOL_NAME, description="Run a shell command", parameters_json_schema=SHELL_SCHEMA
            )
        ]
    )
    config = types.GenerateContentConfig(
        tools=[tool],
        system_instruction=SYSTEM,
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    contents: list = [types.Content(role="user", parts=[types.Part(text=prompt)])]
    commands: list[str] = []
    for turn in range(1, max_turns + 1):
        if stream:
            parts: list = []
            for chunk in client.models.generate_content_stream(
                model="gemini-2.5-flash", contents=contents, config=config
            ):
                if chunk.candidates and chunk.candidates[0].content and chunk.candidates[0].content.parts:
                    parts += chunk.candidates[0].content.parts
        else:
            resp = client.models.generate_content(model="gemini-2.5-flash", contents=contents, config=config)
            parts = list(resp.candidates[0].content.parts or [])
        calls = [p.function_call for p in parts if p.function_call]
        if not calls:
            return SessionResult("".join(p.text or "" for p in parts if not p.thought), turn, commands)
        commands += [dict(c.args or {}).get("command", "") for c in calls]
        contents += [
            types.Content(role="model", parts=parts),
            types.Content(
                role="user",
                parts=[
                    types.Part.from_function_response(
                        name=c.name, response={"output": run_tool(dict(c.args or {}))}
                    )
                    for c in calls
                ],
            ),
        ]
    return SessionResult("", max_turns, commands)


DRIVERS: dict[str, Callable[..., SessionResult]] = {
    "anthropic": anthropic_session,
    "openai_chat": openai_chat_session,
    "openai_responses": openai_responses_session,
    "google": google_session,
}


def base_url_for(provider: str, gateway_url: str, prefix: str) -> str:
    """The SDK base URL that routes `provider` through a reverse gateway with a `/t/TASK/s/SESSION` prefix."""
    return sdk_base_url(provider, gateway_url + prefix)


def shell_runner(workdir: str, *, timeout: float = 60.0, max_output: int = 4000) -> ToolRunner:
    """A tool runner that really runs `command` with bash in `workdir` (output and errors truncated)."""
    import subprocess

    def run(args: dict) -> str:
        command = str(args.get("command", ""))
        try:
            done = subprocess.run(
                ["bash", "-c", command], cwd=workdir, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return f"error: timed out after {timeout:.0f}s"
        out = (done.stdout + done.stderr)[-max_output:]
        return f"exit code {done.returncode}\n{out}"

    return run
