"""What token-exact prompts cost the gateway, and what they save the engine, per call of a 10-turn session.

For sessions whose last prompt is ~1k, ~8k and ~32k tokens (Qwen's real BPE and chat template, the tiny model's
tokenizer), each call goes through the gateway's prompt step (`gateway/prompts.py`) in three ways, interleaved in
the same run so that machine load hits them alike:

  messages:     the request is serialised; the engine will render and tokenize the whole prompt itself.
  tokens, full: the gateway renders the whole conversation to text (jinja), routes to the session's chain,
                tokenizes only the new tail and sends `input_ids`; after the answer it advances the chain — the
                prompt step before incremental rendering (`PromptBuilder(incremental=False)`).
  tokens:       the same, but a call that extends its chain's tip renders only the messages it adds
                (`gateway/incremental_render.py`; the default).

Printed per prompt size: the gateway's prepare+complete time per call (p50/p99) of each, the added latency of
tokens mode (tokens − messages) before/after, and the engine-side work tokens mode removes (a full chat-template
render + tokenization, measured with the same tokenizer: what SGLang does per call in messages mode).
A full render costs ~35 µs per message, so its share grows with the session's message count, not its tokens:
`--turns 60` (122 messages) shows the long agent sessions harnesses produce.
Run: .venv/bin/python benchmarks/bench_token_exact.py [--repeats 5] [--turns 10]
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


def session(total_tokens: int, turns: int = TURNS) -> list[list[Message]]:
    """The message lists of a `turns`-call session whose last prompt holds about `total_tokens` tokens."""
    per_turn = total_tokens // (turns + 1)
    history = [
        Message(role="system", content="You are a coding agent. " + "Follow the rules. " * (per_turn // 4)),
        Message(role="user", content="Fix the failing test in the repository."),
    ]
    calls = []
    for turn in range(turns):
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


def render_costs(model_dir: str, calls: list[list[Message]]) -> dict[str, list[float]]:
    """Per call 2–n (ms): rendering the whole prompt, rendering only what it adds to the previous call's prompt
    (incremental), and tokenizing only its new tail (what tokens mode must do in any case)."""
    from polar_mitm.gateway.prompts import rendered_tip
    from polar_mitm.gateway.renderer import PromptRenderer

    renderer = PromptRenderer.load(model_dir)
    requests = [request_of(messages) for messages in calls]
    texts = [renderer.render(request) for request in requests]
    costs: dict[str, list[float]] = {"full render": [], "incremental render": [], "tail tokenization": []}
    tip = rendered_tip(requests[0], texts[0])
    for request, text in zip(requests[1:], texts[1:], strict=False):
        started = time.perf_counter()
        renderer.render(request)
        costs["full render"].append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        incremental = renderer.render_after_tip(request, [tip])
        costs["incremental render"].append((time.perf_counter() - started) * 1e3)
        assert incremental is not None and incremental.text == text, "incremental must equal the full render"
        tail = text[text.find(renderer.eot_text, len(tip.text)) + len(renderer.eot_text) :]
        tip = incremental
        started = time.perf_counter()
        renderer.encode(tail)
        costs["tail tokenization"].append((time.perf_counter() - started) * 1e3)
    return costs


def quantiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


VARIANTS = {  # name -> PromptBuilder arguments
    "messages": {"mode": "messages"},
    "tokens, full render": {"mode": "tokens", "incremental": False},
    "tokens": {"mode": "tokens"},
}


async def main(repeats: int, turns: int) -> None:
    from transformers import AutoTokenizer

    model_dir = resolve_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eot_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    print(f"{turns}-call sessions, {repeats} repeats per size; Qwen BPE + chat template ({model_dir.name})")
    print(
        f"{'last prompt':>12} {'messages':>10} {'tokens, full render':>20} {'tokens':>14} "
        f"{'added, full render':>19} {'added':>14} {'engine render+tokenize':>23}"
    )
    print(
        f"{'(tokens)':>12} {'p50/p99 ms':>10} {'p50/p99 ms':>20} {'p50/p99 ms':>14} {'p50/p99 ms':>19} {'p50/p99 ms':>14} {'saved p50 ms':>23}"
    )
    for target in (1_000, 8_000, 32_000):
        calls = session(target, turns)
        results: dict[str, list[float]] = {name: [] for name in VARIANTS}
        builders = {name: PromptBuilder(tokenizer=str(model_dir), **args) for name, args in VARIANTS.items()}
        length = 0
        for r in range(repeats):  # interleaved: load hits every variant alike
            for name, builder in builders.items():
                times, length = await run_session(builder, f"s{r}", calls, tokenizer, eot_id)
                results[name] += times[1:]  # a session's first call is rendered by the engine: shown apart
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
        cells = [quantiles(results[name]) for name in VARIANTS]
        added = [quantiles(differences(results[name], results["messages"])) for name in list(VARIANTS)[1:]]
        print(
            f"{length:>12,} "
            + " ".join(
                f"{p50:{w - 7}.2f}/{p99:6.2f}"
                for (p50, p99), w in zip([*cells, *added], (10, 20, 14, 19, 14), strict=True)
            )
            + f" {statistics.median(engine_ms):23.1f}"
        )
        costs = render_costs(str(model_dir), calls)
        print(
            f"{'':>12} of which, per call (p50): "
            + ", ".join(f"{name} {statistics.median(values):.2f} ms" for name, values in costs.items())
        )
    print(
        "added = tokens − messages gateway time per call (calls 2–n; each session's first call is rendered by "
        "the engine and checked in a worker thread while the engine runs)."
    )


def differences(values: list[float], baseline: list[float]) -> list[float]:
    """Quantile-wise differences (the sorted lists paired), so p50/p99 of the result are p50/p99 differences."""
    return [a - b for a, b in zip(sorted(values), sorted(baseline), strict=True)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--turns", type=int, default=TURNS, help="calls per session (messages grow 2 per call)"
    )
    args = parser.parse_args()
    asyncio.run(main(args.repeats, args.turns))
