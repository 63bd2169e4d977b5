"""A LoRA adapter pushed to vLLM without a restart (`POST /v1/load_lora_adapter`): calls that name it are answered
by the base weights plus the adapter, exactly as transformers runs the merged model.

The session's vLLM is started with `--enable-lora` (tests/vllm/conftest.py); the adapter is PEFT's, on every
linear layer of the tiny model (head_dim 32, tied head), with random non-zero weights so that it changes every
answer.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines import keyed

LOGPROB_TOLERANCE = 1e-4  # fp32 on CPU
ADAPTER_NAME = "polar-lora-test"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def adapter_and_merged(vllm_model_dir, tmp_path):
    """(adapter directory, merged model directory) of one random LoRA adapter of rank 8."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(base, config)
    model.save_pretrained(tmp_path / "adapter")
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    return tmp_path / "adapter", tmp_path / "merged"


def sample(vllm_url: str, model: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    response = keyed.post(f"{vllm_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_a_hot_loaded_lora_adapter_answers_as_the_merged_model(
    vllm_url, vllm_model_dir, vllm_reference, adapter_and_merged
):
    adapter, merged = adapter_and_merged
    prompt = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]
    loaded = keyed.post(
        f"{vllm_url}/v1/load_lora_adapter",
        json={"lora_name": ADAPTER_NAME, "lora_path": str(adapter)},
        timeout=120,
    )
    assert loaded.status_code == 200, loaded.text
    try:
        served = [m["id"] for m in keyed.get(f"{vllm_url}/v1/models", timeout=30).json()["data"]]
        assert ADAPTER_NAME in served
        ids, logprobs = sample(vllm_url, ADAPTER_NAME, prompt)
        gap = max_gap(logprobs, vllm_reference(prompt, ids, merged))
        off_base = max_gap(logprobs, vllm_reference(prompt, ids, vllm_model_dir))
        print(f"LoRA on vLLM: max |Δ| vs the merged model {gap:.1e}, vs the base {off_base:.1e}")
        assert gap <= LOGPROB_TOLERANCE
        assert off_base > 1e-2  # the adapter is in the answer
        base_name = next(name for name in served if name != ADAPTER_NAME)
        base_ids, base_logprobs = sample(vllm_url, base_name, prompt)  # the base model is served as it was
        assert max_gap(base_logprobs, vllm_reference(prompt, base_ids)) <= LOGPROB_TOLERANCE
    finally:
        keyed.post(f"{vllm_url}/v1/unload_lora_adapter", json={"lora_name": ADAPTER_NAME}, timeout=60)
