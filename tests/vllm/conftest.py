"""vLLM for the engine tests: one real vLLM server (CPU build, its own venv) for the tests under tests/vllm/, and one
gateway in front of it. vLLM takes 45–76 s and ~4 GB to start, so every vLLM test shares these; they are skipped —
with the reason — only where scripts/setup-vllm.sh has not been run (scripts/test.sh runs it, so CI always has vLLM).
They are package-scoped: the files run together on one worker (tests/suite_timing.py), and the server goes when the
last of them ends, not at the end of the run — idle, it still held ~4 GB and a few percent of a core for the rest of
the suite (25 minutes of the last run).

The server samples freely unless a test makes it play a script (`vllm_script`: the scripted test policy,
polar_mitm/vllm/scripted.py, loaded at start and inert until then), so scripted harness sessions share it too.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.vllm.server import resolve_vllm_model, vllm_installed, vllm_playing, vllm_running

# Every sampled call at T=1 (so a recorded logprob is directly the model's log-probability) and short.
VLLM_GATEWAY_OPTIONS = {"polar_temperature": "1.0", "polar_max_tokens": "12", "polar_engine": "auto"}
# Room for the harnesses' prompts through the proxy (Qwen Code's first is ~17k tokens); the tiny model's KV cache
# is 512 bytes a token, so this costs nothing. LoRA on, for adapters pushed at run time (test_vllm_lora.py).
VLLM_EXTRA_ARGS = ["--max-model-len", "32768", "--enable-lora", "--max-lora-rank", "8"]
# Seconds vLLM rests after each step while a test acts in the middle of a call (`vllm_paced`): on a loaded 2-core
# machine its engine can hold the cores for a whole call, and its server then streams the call in one burst at the
# end (measured: the first chunk 15 s into a 15 s call), so an abort or a push sent at the Nth chunk comes too late.
MID_CALL_PACE = 0.005


@pytest.fixture(scope="package")
def vllm_model_dir() -> Path:
    """The tiny model at the head_dim vLLM's CPU attention accepts (the suite's own model has head_dim 16)."""
    return resolve_vllm_model("tiny")


@pytest.fixture(scope="package")
def vllm_url(vllm_model_dir, tmp_path_factory):
    """`polar-mitm vllm serve tiny` for the session (its startup time is printed: a measured figure)."""
    if not vllm_installed():
        pytest.skip("vLLM is not installed here: run `bash scripts/setup-vllm.sh` (scripts/test.sh does)")
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    started = time.monotonic()
    with vllm_running(
        vllm_model_dir,
        log=log,
        scripted_policy=True,
        extra_args=VLLM_EXTRA_ARGS,
    ) as url:
        print(f"\nvLLM up in {time.monotonic() - started:.1f} s (log: {log})")
        yield url


@pytest.fixture(scope="package")
def vllm_gateway(vllm_url, tmp_path_factory):
    """mitmdump + addon/polar.py in front of vLLM (regular and reverse listeners), tokens mode."""
    root = tmp_path_factory.mktemp("vllm-gateway")
    with gateway_processes.gateway_running(
        vllm_url,
        root / "flows",
        confdir=root / "conf",
        log=root / "gateway.log",
        options=VLLM_GATEWAY_OPTIONS,
    ) as gateway:
        gateway.log = root / "gateway.log"
        yield gateway


@pytest.fixture(scope="package")
def vllm_reference(vllm_model_dir):
    """transformers on the same checkpoint: log-probabilities of given tokens after a given context, at a given
    temperature (log_softmax(logits / T): what the trainer computes)."""
    import torch
    from transformers import AutoModelForCausalLM

    models: dict[Path, object] = {}

    def score(
        prompt_ids: list[int],
        sampled_ids: list[int],
        model_dir: Path = vllm_model_dir,
        temperature: float = 1.0,
    ) -> list[float]:
        if model_dir not in models:
            models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = models[model_dir](torch.tensor([prompt_ids + sampled_ids])).logits[0]
        logprobs = (logits.float() / temperature).log_softmax(-1)
        start = len(prompt_ids) - 1
        return [logprobs[start + i, token].item() for i, token in enumerate(sampled_ids)]

    return score


@pytest.fixture(scope="package")
def vllm_script(vllm_url, tmp_path_factory):
    """`with vllm_script(SCRIPT):` the session's vLLM plays SCRIPT (engine/script.py's format), then samples freely."""
    scripts = tmp_path_factory.mktemp("vllm-scripts")

    @contextmanager
    def playing(script: dict | list):
        path = scripts / f"script-{len(list(scripts.iterdir()))}.json"
        path.write_text(json.dumps(script, indent=1))
        with vllm_playing(vllm_url, path):
            yield path

    return playing
