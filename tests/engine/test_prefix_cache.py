"""The embedded engine's prefix cache: a call that extends an earlier one reuses its keys and values, exactly."""

from __future__ import annotations

import random

from openai import OpenAI

from polar_mitm.engine.generation import Engine
from polar_mitm.engine.prefix_cache import MIN_REUSE_TOKENS, PrefixCache
from polar_mitm.engine.sampling import SamplingParams
from polar_mitm.engines import keys as engine_keys


def test_extending_calls_reuse_the_cache_and_sample_the_same_ids_and_logprobs(tiny_model_dir, tiny_engine):
    """Four agent-like turns (history + answer + tool output): ids and logprobs equal an engine without the cache."""
    uncached = Engine(tiny_model_dir, prefix_cache_bytes=0)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 50000) for _ in range(3000)]
    params = SamplingParams(max_new_tokens=16, temperature=0.7, sampling_seed=1)
    reused = []
    for _ in range(4):
        cached, fresh = tiny_engine.generate(prompt, params), uncached.generate(prompt, params)
        assert fresh.cached_tokens == 0
        assert cached.output_ids == fresh.output_ids
        assert (
            max(abs(a - b) for a, b in zip(cached.output_logprobs, fresh.output_logprobs, strict=True))
            <= 1e-5
        )  # prefill chunking moves the last bits
        reused.append(cached.cached_tokens)
        prompt = prompt + cached.output_ids + [rng.randrange(1000, 50000) for _ in range(300)]
    # Each turn after the first reuses everything the previous one fed: its prompt and all but its last token.
    assert reused[0] == 0
    assert reused[1:] == [3000 + 15, 3000 + 316 + 15, 3000 + 2 * 316 + 15]


def test_a_diverging_prompt_reuses_only_the_common_prefix(tiny_model_dir):
    engine = Engine(tiny_model_dir)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, sampling_seed=2)
    base = list(range(1000, 1400))
    engine.generate(base, params)
    branch = base[:250] + list(range(5000, 5100))
    got = engine.generate(branch, params)
    assert got.cached_tokens == 250
    fresh = Engine(tiny_model_dir, prefix_cache_bytes=0).generate(branch, params)
    assert got.output_ids == fresh.output_ids
    assert max(abs(a - b) for a, b in zip(got.output_logprobs, fresh.output_logprobs, strict=True)) <= 1e-5
    # Too short a shared prefix is not worth a lookup; a weight update empties the pool.
    assert engine.generate(list(range(MIN_REUSE_TOKENS - 1)) + [9], params).cached_tokens == 0
    engine.update_weights_from_disk(tiny_model_dir)
    assert len(engine.prefix_cache) == 0 and engine.generate(branch, params).cached_tokens == 0


def test_the_pool_stays_within_its_byte_budget():
    class FakeLayer:  # the two tensors a DynamicCache layer holds, sized in bytes
        def __init__(self, n):
            import torch

            self.keys = self.values = torch.zeros(n, dtype=torch.uint8)

    class FakeCache:
        def __init__(self, n):
            self.layers = [FakeLayer(n)]

    pool = PrefixCache(budget_bytes=1000)
    for k in range(5):
        pool.put(list(range(k * 100, k * 100 + 100)), FakeCache(200))  # 400 bytes each
    assert len(pool) == 2 and pool.nbytes == 800
    assert pool.take(list(range(0, 100))) is None  # the oldest went first


def test_served_second_turn_reports_cached_tokens_and_true_logprobs(engine_url, tiny_engine):
    client = OpenAI(
        base_url=f"{engine_url}/v1", api_key=engine_keys.key_for(engine_url) or "unused", max_retries=0
    )
    messages = [
        {"role": "system", "content": "You are a coding agent. " * 40},
        {"role": "user", "content": "List the files."},
    ]

    def call(msgs):
        return client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=8,
            temperature=1.0,
            seed=5,
            logprobs=True,
            extra_body={"return_token_ids": True, "return_meta_info": True, "ignore_eos": True},
        ).choices[0]

    first = call(messages)
    second = call(
        [
            *messages,
            {"role": "assistant", "content": first.message.content},
            {"role": "user", "content": "Again."},
        ]
    )
    prompt_ids = second.model_extra["prompt_token_ids"]
    first_prompt = first.model_extra["prompt_token_ids"]
    assert second.model_extra["meta_info"]["cached_tokens"] >= len(first_prompt)
    scored = tiny_engine.score(prompt_ids, second.model_extra["response_token_ids"])
    served = [e.logprob for e in second.logprobs.content]
    assert max(abs(a - b) for a, b in zip(served, scored, strict=True)) <= 1e-4
