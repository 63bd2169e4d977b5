"""What token-exact prompts cost the gateway, and what they save the engine, per call of a 10-turn session.

For sessions whose last prompt is ~8k and ~32k tokens (Qwen's real BPE and chat template, the tiny model's
tokenizer), each of the 10 calls goes through the gateway's prompt step (`gateway/prompts.py`) in both modes,
in the same run:

  messages: the request is serialised; the engine will render and tokenize the whole prompt itself.
  tokens:   the gateway renders the messages to text, routes to the session's chain, tokenizes only the new
            tail and sends `input_ids`; after the answer it advances the chain. The engine skips its template.

Printed per prompt size: the gateway's prepare+complete time per call in each mode (p50/p99) and the added
latency (tokens − messages), next to the engine-side work tokens mode removes (a full chat-template render +
tokenization of the prompt, measured with the same tokenizer: what SGLang does per call in messages mode).
Run: .venv/bin/python benchmarks/bench_token_exact.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from polar_mitm.conversation import Completion, Message, ToolCall
from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.gateway.prompts import PromptBuilder

TURNS = 10
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def session(total_tokens: int) -> list[list[Message]]:
    """The message lists of a 10-call session whose last prompt holds about `total_tokens` tokens."""
    per_turn = total_tokens // (TURNS + 1)
    history = [
        Message(role="system", content="You are a coding agent. " + "Follow the rules. " * (per_turn // 4)),
        Message(role="user", content="Fix the failing test in the repository."),
    ]
    calls = []
    for turn in range(TURNS):
        calls.append(list(history))
        call = ToolCall(id=f"call_{turn}", name="shell", arguments='{"command": "cat src/module.py"}')
        history.append(
            Message(role="assistant", content=f"Step {turn}: reading the file.", tool_calls=[call])
        )
        history.append(Message(role="tool", tool_call_id=call.id, content="line of code\n" * (per_turn // 4)))
    return calls


def request_of(messages: list[Message]) -> dict[str, Any]:
    return {
        "model": "default",
        "messages": [m.to_engine() for m in messages],
        "tools": TOOLS,
        "stream": False,
        "logprobs": True,
        "return_token_ids": True,
        "return_meta_info": True,
        "temperature": 1.0,
    }


async def run_session(
    builder: PromptBuilder, name: str, calls: list[list[Message]], tokenizer, eot_id: int
) -> tuple[list[float], int]:
    """Per-call gateway prompt time (ms) over one session; also the last prompt's length."""
    from polar_mitm.conversation import Conversation

    times, length = [], 0
    for turn, messages in enumerate(calls):
        conv = Conversation(messages=messages)
        request = request_of(messages)
        started = time.perf_counter()
        step, _body = await builder.prepare(name, conv, request)
        prepare_s = time.perf_counter() - started
        # The engine's answer: it saw input_ids (tokens mode) or rendered the messages itself.
        prompt = request.get("input_ids") or tokenizer.apply_chat_template(
            request["messages"], tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        answer = f"Step {turn}: reading the file."
        sampled = tokenizer.encode(
            answer + '\n<tool_call>\n{"name": "shell", "arguments": '
            '{"command": "cat src/module.py"}}\n</tool_call>',
            add_special_tokens=False,
        )
        completion = Completion(
            id="x",
            model="m",
            content=answer,
            reasoning=None,
            tool_calls=[ToolCall(id="c", name="shell", arguments='{"command": "cat src/module.py"}')],
            finish_reason="tool_calls",
            prompt_ids=list(prompt),
            completion_ids=[*sampled, eot_id],
            completion_logprobs=[-0.1] * (len(sampled) + 1),
        )
        started = time.perf_counter()
        await builder.complete(step, completion)
        times.append((prepare_s + time.perf_counter() - started) * 1e3)
        length = len(prompt)
        if builder.mode == "tokens" and turn > 0:
            assert step.mode == "tokens", step.reason
    return times, length


def tail_costs(model_dir: str, calls: list[list[Message]]) -> tuple[list[float], list[float]]:
    """Per call 2–10 (ms): rendering the whole prompt, and tokenizing only its new tail (what tokens mode must do)."""
    from polar_mitm.gateway.renderer import PromptRenderer

    renderer = PromptRenderer.load(model_dir)
    texts = [renderer.render(request_of(messages)) for messages in calls]
    tail_ms, render_ms = [], []
    for previous, messages, text in zip(texts, calls[1:], texts[1:], strict=False):
        started = time.perf_counter()
        renderer.render(request_of(messages))
        render_ms.append((time.perf_counter() - started) * 1e3)
        tail = text[text.find(renderer.eot_text, len(previous)) + len(renderer.eot_text) :]
        started = time.perf_counter()
        renderer.encode(tail)
        tail_ms.append((time.perf_counter() - started) * 1e3)
    return tail_ms, render_ms


def quantiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def main(repeats: int) -> None:
    from transformers import AutoTokenizer

    model_dir = resolve_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eot_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    print(f"10-call sessions, {repeats} repeats per size; Qwen BPE + chat template ({model_dir.name})")
    print(
        f"{'last prompt':>12} {'messages p50/p99':>18} {'tokens p50/p99':>18} {'added p50/p99':>16} "
        f"{'engine render+tokenize saved p50':>34}"
    )
    for target in (8_000, 32_000):
        calls = session(target)
        results: dict[str, list[float]] = {"messages": [], "tokens": []}
        length = 0
        for mode in ("messages", "tokens"):
            builder = PromptBuilder(mode, tokenizer=str(model_dir))
            for r in range(repeats):
                times, length = await run_session(builder, f"s{r}", calls, tokenizer, eot_id)
                results[mode] += times[
                    1:
                ]  # the first call of a session renders in full by design: shown apart
        engine_ms = []
        for messages in calls[1:]:
            started = time.perf_counter()
            tokenizer.apply_chat_template(
                request_of(messages)["messages"],
                tools=TOOLS,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            engine_ms.append((time.perf_counter() - started) * 1e3)
        tail_ms, render_ms = tail_costs(str(model_dir), calls)
        (m50, m99), (t50, t99) = quantiles(results["messages"]), quantiles(results["tokens"])
        added = [t - m for t, m in zip(sorted(results["tokens"]), sorted(results["messages"]), strict=True)]
        a50, a99 = quantiles(added)
        print(
            f"{length:>12,} {m50:8.2f}/{m99:6.2f} ms {t50:8.2f}/{t99:6.2f} ms {a50:7.2f}/{a99:6.2f} ms "
            f"{statistics.median(engine_ms):28.1f} ms"
        )
        print(
            f"{'':>12} of which, per call (p50): full render {statistics.median(render_ms):.2f} ms, "
            f"tokenizing the new tail alone {statistics.median(tail_ms):.2f} ms"
        )
    print(
        "added = tokens − messages gateway time per call (calls 2–10; each session's first call is rendered by "
        "the engine and checked in a worker thread while the engine runs)."
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    asyncio.run(main(parser.parse_args().repeats))
