"""One `polar-mitm loop` iteration on vLLM: rollout through the gateway → merge → GRPO → push → vLLM's next call.

The demo's tasks and scripted choice policy (examples/cpu_tasks/policy.json), played by the session's vLLM
(polar_mitm/vllm/scripted.py) instead of the embedded engine: at each task's first turn vLLM writes one of two
candidate tool calls, chosen by the model's own probabilities, so rewards vary inside a group and GRPO has
something to learn. The loop attaches to vLLM (`engine_url`) and starts from the same checkpoint (the tiny model at
head_dim 32, whose output head is tied to its embedding); after the push, vLLM's logprobs must be transformers'
with the new weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.demo import DEMO_LEARNING_RATE
from polar_mitm.engines import weights
from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.loop import Loop
from polar_mitm.storage.records import read_all
from tests.engines import keyed

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"
LOGPROB_TOLERANCE = 1e-4  # fp32 on CPU


def sample_call(vllm_url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """vLLM's next call: 8 tokens sampled at T=1 after `prompt`, with their reported logprobs."""
    served = keyed.get(f"{vllm_url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {
        "model": served,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    choice = keyed.post(f"{vllm_url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_one_loop_iteration_on_vllm_trains_pushes_and_vllm_serves_the_new_weights(
    vllm_url, vllm_model_dir, vllm_reference, vllm_script, tmp_path
):
    assert json.loads((vllm_model_dir / "config.json").read_text())["tie_word_embeddings"] is True
    before = weights.engine_weight_version(vllm_url)
    cfg = LoopConfig(
        tasks=EXAMPLES / "tasks.jsonl",
        run_dir=tmp_path / "run",
        iterations=1,
        group_size=4,
        concurrency=4,
        model=str(vllm_model_dir),
        engine_url=vllm_url,
        learning_rate=DEMO_LEARNING_RATE,
        max_tokens=128,
    )
    loop = Loop(cfg)
    try:
        with vllm_script(json.loads((EXAMPLES / "policy.json").read_text())):
            (stats,) = loop.run()
        records = read_all(tmp_path / "run" / "iter-0" / "flows").to_pylist()
        assert {json.loads(r["engine_meta_json"])["engine"] for r in records} == {"vllm"}
        assert {r["weight_version"] for r in records} == {before}
        assert stats.sessions == 12 and stats.sequences >= 12 and stats.trainable_tokens > 0
        rewards: dict[str, set[float]] = {}
        for row in pq.read_table(tmp_path / "run" / "iter-0" / "rewards.parquet").to_pylist():
            rewards.setdefault(row["task_id"], set()).add(row["reward"])
        assert any(len(seen) > 1 for seen in rewards.values()), rewards  # a group with advantages to follow
        assert stats.weight_version is not None and stats.weight_version != before
        assert weights.engine_weight_version(vllm_url) == stats.weight_version

        trained = loop.model_dir
        prompt = records[0]["prompt_ids"]
        sampled, logprobs = sample_call(vllm_url, prompt)
        gap = max_gap(logprobs, vllm_reference(prompt, sampled, trained))
        moved = max_gap(logprobs, vllm_reference(prompt, sampled, vllm_model_dir))
        print(
            f"loop on vLLM: rewards by task {rewards}, version {before} → {stats.weight_version}, "
            f"seconds {stats.seconds}; next call vs transformers: new weights {gap:.1e}, old {moved:.1e}"
        )
        assert gap <= LOGPROB_TOLERANCE
        assert moved > 1e-3  # the weights did change, and vLLM serves the changed ones
    finally:
        weights.push_weights(vllm_url, vllm_model_dir)  # the session's other tests score the original weights
