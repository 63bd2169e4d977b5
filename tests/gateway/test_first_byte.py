"""First byte first: a session's first call goes to the engine without waiting for the gateway's own rendering;
that rendering (the chain's tip, and the check against the engine's prompt ids) runs alongside the engine call,
and a mismatch found there still moves the session to messages mode from its next call on."""

from __future__ import annotations

import asyncio
import threading

import orjson

from polar_mitm.conversation import Completion, Conversation, Message
from polar_mitm.gateway.prompts import PromptBuilder
from polar_mitm.gateway.token_chains import NO_CHAIN, RENDERER_MISMATCH, SESSION_FALLBACK

MESSAGES = [Message(role="user", content="List the files.")]


def request_of(messages: list[Message]) -> dict:
    return {"model": "tiny", "messages": [m.to_engine() for m in messages], "stream": False}


def completion(prompt_ids: list[int], eot_id: int) -> Completion:
    return Completion(
        id="c",
        model="tiny",
        content="Here.",
        reasoning=None,
        tool_calls=[],
        finish_reason="stop",
        prompt_ids=prompt_ids,
        completion_ids=[11, eot_id],
        completion_logprobs=[-0.1, -0.2],
    )


async def first_call_then_second(builder: PromptBuilder, engine_prompt_ids) -> tuple:
    """Prepare a session's first call while our rendering is held back; complete it; prepare the second."""
    renderer = await builder.warm()
    assert renderer is not None
    released = threading.Event()
    render = renderer.render

    def held_render(request: dict) -> str:  # the real rendering, held until the engine request is out
        assert released.wait(30)
        return render(request)

    renderer.render = held_render
    request = request_of(MESSAGES)
    step, body = await asyncio.wait_for(builder.prepare("s", Conversation(messages=MESSAGES), request), 10)
    sent_before_render = not released.is_set()
    released.set()
    renderer.render = render
    ids = engine_prompt_ids(renderer, request)
    await builder.complete(step, completion(ids, renderer.eot_id))
    history = [*MESSAGES, Message(role="assistant", content="Here."), Message(role="user", content="Thanks.")]
    second, _ = await builder.prepare("s", Conversation(messages=history), request_of(history))
    return sent_before_render, step, orjson.loads(body), second


def test_a_first_call_is_sent_before_our_rendering_and_its_chain_opens(tiny_model_dir):
    builder = PromptBuilder("tokens", tokenizer=str(tiny_model_dir))
    sent_early, step, body, second = asyncio.run(
        first_call_then_second(builder, lambda renderer, request: renderer.encode(renderer.render(request)))
    )
    assert sent_early and step.reason == NO_CHAIN and "input_ids" not in body
    assert (
        second.mode == "tokens" and second.spliced_turns == 1
    )  # the tip rendered alongside opened the chain


def test_a_mismatch_found_alongside_the_engine_call_demotes_the_session(tiny_model_dir):
    builder = PromptBuilder("tokens", tokenizer=str(tiny_model_dir))
    sent_early, step, _body, second = asyncio.run(
        first_call_then_second(
            builder, lambda renderer, request: [7, *renderer.encode(renderer.render(request))]
        )
    )
    assert sent_early and step.reason == RENDERER_MISMATCH
    assert second.mode == "messages" and second.reason == SESSION_FALLBACK
