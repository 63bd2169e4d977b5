"""The embedded engine's in-flight weight update: a push lands between two tokens of a running generation (not
after it), the rest is sampled and scored by the new weights, and the answer's meta says where; with no
generation running the push swaps at once."""

from __future__ import annotations

import threading

import torch

from polar_mitm.engine.generation import Engine
from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.engine.sampling import SamplingParams


def test_a_push_during_generation_starts_a_new_span_at_the_next_token():
    engine = Engine(resolve_model("tiny"))
    new_weights = resolve_model("tiny", seed=1)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, sampling_seed=3)
    prompt = engine.tokenizer.encode("Hello there", add_special_tokens=False)
    gate, pushed = threading.Event(), {}

    def on_token(step) -> None:
        if len(seen) == 3:
            gate.set()
            pushed["swapped"].wait(30)  # hold the generation until the push is handed over
        seen.append(step)

    seen: list = []
    pushed["swapped"] = threading.Event()

    def push() -> None:
        gate.wait(30)
        loader = threading.Thread(
            target=lambda: pushed.update(v=engine.update_weights_from_disk(new_weights))
        )
        loader.start()
        while engine._pending is None and loader.is_alive():
            loader.join(0.01)
        pushed["swapped"].set()
        loader.join(60)

    pusher = threading.Thread(target=push)
    pusher.start()
    gen = engine.generate(prompt, params, on_token=on_token)
    pusher.join(60)
    assert pushed["v"] == "1" and engine.weight_version == "1"
    k = gen.version_spans[1][0]
    assert gen.version_spans == [(0, "0"), (k, "1")] and 3 < k < 24  # landed mid-generation
    assert gen.meta_info()["version_spans"] == [{"start": 0, "version": "0"}, {"start": k, "version": "1"}]
    assert [s.weight_version for s in seen] == ["0"] * k + ["1"] * (24 - k)
    rescored = Engine(new_weights).score(prompt + gen.output_ids[:k], gen.output_ids[k:], temperature=1.0)
    assert float((torch.tensor(gen.output_logprobs[k:]) - torch.tensor(rescored)).abs().max()) <= 1e-5


def test_a_push_without_a_running_generation_swaps_at_once():
    engine = Engine(resolve_model("tiny"))
    assert engine.update_weights_from_disk(resolve_model("tiny", seed=1)) == "1"
    assert engine.weight_version == "1" and engine._pending is None
    gen = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True))
    assert gen.version_spans == [(0, "1")]
