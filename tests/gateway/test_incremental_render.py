"""Incremental token-exact rendering (gateway/incremental_render.py) equals the full render, or is not used.

On every recorded session (sample_flows/: the SDK sessions and every harness's) and for both of the project's chat
templates: the text built from a chain tip plus the new messages equals the full jinja render, and the gateway's
prompt step gives the engine the very same input_ids with incremental rendering on as off. Random conversations
probe the argument's conditions (a new query, a tool after a tool, an assistant at the tip, kwargs); a template the
argument was not made for is always rendered in full.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any

import pytest

from polar_mitm.conversation import Completion, Message
from polar_mitm.engine.tiny_model import chat_template
from polar_mitm.gateway.incremental_render import (
    LOCAL_TEMPLATES,
    RenderedTip,
    render_after_tip,
    template_hash,
)
from polar_mitm.gateway.prompts import PromptBuilder, rendered_tip
from polar_mitm.gateway.renderer import PromptRenderer
from tests.gateway.sample_sessions import TEMPLATES, conversations, engine_requests, tokenizer_with_template


@pytest.fixture(scope="module", params=TEMPLATES)
def template_dir(request, tiny_model_dir, tmp_path_factory):
    return tokenizer_with_template(tiny_model_dir, request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def renderer(template_dir):
    return PromptRenderer.load(str(template_dir))


def test_the_argument_covers_exactly_the_projects_templates():
    # Editing a template (or adding one) must come with its own argument in incremental_render.py.
    assert LOCAL_TEMPLATES == {name: template_hash(chat_template(name)) for name in TEMPLATES}


def test_incremental_text_equals_the_full_render_on_every_recorded_session(renderer):
    assert renderer.local == {"default"}
    tips: dict[str, list[RenderedTip]] = defaultdict(list)
    incremental: set[str] = set()
    for source, session, request in engine_requests():
        full = renderer.render(request)
        tip = renderer.render_after_tip(request, sorted(tips[session], key=lambda t: -len(t.messages)))
        if tip is not None:  # built on the earlier tips as a chain keeps them (with their window heads)
            assert tip.text == full, source
            assert renderer.encode(tip.text) == renderer.encode(full)
            incremental.add(source)
        tips[session].append(tip or rendered_tip(request, full))
    # Follow-up calls of these sessions extend their tips; a scheme that never applies would pass vacuously.
    assert {"sdk_sessions", "claude-code", "codex", "gemini", "opencode", "pi", "qwen"} <= incremental


def completion_from(
    next_messages: list[Message], index: int, prompt_ids: list[int], eot_id: int
) -> Completion:
    """The engine's answer as the harness copied it into its next call (so the chain extends)."""
    copy = next_messages[index] if index < len(next_messages) else Message(role="assistant", content="ok")
    return Completion(
        id="c",
        model="m",
        content=copy.content or "",
        reasoning=copy.reasoning,
        tool_calls=list(copy.tool_calls),
        finish_reason="tool_calls" if copy.tool_calls else "stop",
        prompt_ids=list(prompt_ids),
        completion_ids=[17, 42, eot_id],
        completion_logprobs=[-0.1] * 3,
    )


async def drive(builder: PromptBuilder, calls: list[tuple[str, Any]], eot_id: int) -> list[tuple]:
    """Every recorded call through the prompt step; what the engine is sent, per call."""
    by_session: dict[str, list] = defaultdict(list)
    for session, conv in calls:
        by_session[session].append(conv)
    sent = []
    for session, convs in by_session.items():
        for turn, conv in enumerate(convs):
            request = conv.to_engine_request()
            step, _body = await builder.prepare(session, conv, request)
            prompt = step.plan.input_ids if step.plan and step.plan.input_ids is not None else None
            if prompt is None:
                prompt = await step.check_ids if step.check_ids is not None else []
            sent.append((session, turn, step.mode, step.reason, request.get("input_ids")))
            following = convs[turn + 1].messages if turn + 1 < len(convs) else []
            await builder.complete(step, completion_from(following, len(conv.messages), prompt, eot_id))
    return sent


def test_the_prompt_step_sends_identical_ids_with_incremental_rendering(template_dir, renderer):
    calls = [(session, conv) for _source, session, conv in conversations()]
    on = PromptBuilder("tokens", tokenizer=str(template_dir))
    off = PromptBuilder("tokens", tokenizer=str(template_dir), incremental=False)
    sent_on = asyncio.run(drive(on, calls, renderer.eot_id))
    sent_off = asyncio.run(drive(off, calls, renderer.eot_id))
    assert sent_on == sent_off
    assert sum(mode == "tokens" for _s, _t, mode, _r, _ids in sent_on) >= 10  # chains did extend


# -- the argument's conditions, on random conversations ---------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "sh", "description": "Run.", "parameters": {"type": "object"}}}
]


def random_message(rng: random.Random, first: bool) -> dict[str, Any]:
    role = rng.choice(["system", "user", "user", "assistant", "assistant", "tool", "tool", "tool"])
    if first:
        role = rng.choice(["system", "system", "user", "tool", "assistant"])
    if role == "user":
        content = rng.choice(["fix it", "<tool_response>\nout\n</tool_response>", None, [{"type": "text"}]])
        return {"role": "user", "content": content}
    if role == "assistant":
        message: dict[str, Any] = {
            "role": "assistant",
            "content": rng.choice(["", "ok", "<think>\nhm\n</think>\n\ndone", "\nstep"]),
        }
        if rng.random() < 0.4:
            message["reasoning_content"] = rng.choice(["", "thinking", "\nplan\n"])
        if rng.random() < 0.5:
            arguments = rng.choice(['{"c": "ls"}', {"c": "ls"}])
            message["tool_calls"] = [
                {"id": "t", "type": "function", "function": {"name": "sh", "arguments": arguments}}
            ]
        return message
    if role == "tool":
        return {"role": "tool", "tool_call_id": "t", "content": rng.choice(["out", "", "a\nb"])}
    return {"role": "system", "content": rng.choice(["be brief", ""])}


def test_random_conversations_are_rendered_exactly_or_in_full(renderer):
    rng = random.Random(28)
    accepted = refused = 0
    for _ in range(400):
        messages = [random_message(rng, first=i == 0) for i in range(rng.randint(2, 9))]
        tools = rng.choice([None, TOOLS])
        kwargs = rng.choice([{}, {"enable_thinking": False}])
        full = renderer.render({"messages": messages, "tools": tools, "chat_template_kwargs": kwargs})
        request = {"messages": messages, "tools": tools, "chat_template_kwargs": kwargs}
        for k in range(
            1, len(messages) + 1
        ):  # every tip, fresh (its window head rendered on this call); k = n: a retry
            tip_text = renderer.render_messages(messages[:k], tools, kwargs)
            tip = renderer.render_after_tip(request, [RenderedTip(messages[:k], tools, kwargs, tip_text)])
            if tip is None:
                refused += 1
            else:
                assert tip.text == full, (messages, k, tools, kwargs)
                accepted += 1
        tip = RenderedTip(messages[:1], tools, kwargs, renderer.render_messages(messages[:1], tools, kwargs))
        for j in range(2, len(messages) + 1):  # a chain of tips, each passing its window head on
            part = {"messages": messages[:j], "tools": tools, "chat_template_kwargs": kwargs}
            text = renderer.render(part)
            extended = renderer.render_after_tip(part, [tip])
            assert extended is None or extended.text == text, (messages, j, tools, kwargs)
            tip = extended or RenderedTip(messages[:j], tools, kwargs, text)
    assert accepted > 500 and refused > 500  # both sides of every condition were exercised


def test_a_new_query_after_the_tip_is_rendered_in_full(renderer):
    # The query moves `last_query_index`: the tip's assistant turn loses its thinking, so the tip's text is no
    # longer a prefix and a splice of it would be wrong.
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a", "reasoning_content": "why"},
        {"role": "tool", "tool_call_id": "t", "content": "out"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "second"},
    ]
    tip = RenderedTip(messages[:4], None, {}, renderer.render_messages(messages[:4], None, {}))
    full = renderer.render({"messages": messages})
    assert not full.startswith(tip.text[: -len("<|im_start|>assistant\n")])
    assert renderer.render_after_tip({"messages": messages}, [tip]) is None


def test_a_tip_that_differs_from_the_calls_messages_is_not_built_on(renderer):
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "x"},
        {"role": "tool", "content": "o"},
    ]
    edited = [{"role": "user", "content": "went"}]
    tip = RenderedTip(edited, None, {}, renderer.render_messages(edited, None, {}))
    assert renderer.render_after_tip({"messages": messages}, [tip]) is None
    tip = RenderedTip(messages[:1], TOOLS, {}, renderer.render_messages(messages[:1], TOOLS, {}))
    assert renderer.render_after_tip({"messages": messages}, [tip]) is None  # other tools than the tip's


def test_a_template_the_argument_was_not_made_for_is_rendered_in_full(template_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (template_dir / name).exists():
            (tmp_path / name).write_bytes((template_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text((template_dir / "chat_template.jinja").read_text() + " ")
    renderer = PromptRenderer.load(str(tmp_path))
    assert renderer.local == frozenset()
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "x"},
        {"role": "tool", "content": "o"},
    ]
    tip = RenderedTip(messages[:1], None, {}, renderer.render_messages(messages[:1], None, {}))
    assert renderer.render_after_tip({"messages": messages}, [tip]) is None


def test_a_window_the_template_refuses_is_rendered_in_full():
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "x"},
        {"role": "tool", "content": "o"},
    ]

    def render(window: list[dict[str, Any]], prompt: bool) -> str:
        if len(window) > 1:
            raise ValueError("conversations must alternate")  # as some templates' raise_exception does
        return "head" + ("<gen>" if prompt else "")

    tip = RenderedTip(messages[:1], None, {}, "head<gen>")
    assert render_after_tip(messages, None, {}, [tip], render) is None
