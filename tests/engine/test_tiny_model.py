"""The tiny offline model: deterministic, small, long context, Qwen's production tokenisation and template."""

from __future__ import annotations

import hashlib

from polar_mitm.engine.tiny_model import build_tiny_model


def digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, tiny_model_dir):
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=1)
    assert digest(a) == digest(tiny_model_dir)
    assert digest(a) != digest(b)


def test_size_context_and_special_token_ids(tiny_engine):
    n_params = sum(p.numel() for p in tiny_engine.model.parameters())
    assert n_params < 6_000_000
    assert tiny_engine.model.config.max_position_embeddings >= 65536
    tok = tiny_engine.tokenizer
    assert [
        tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<tool_call>", "</tool_call>", "<think>")
    ] == [151645, 151657, 151658, 151667]
    # Qwen's BPE: known production ids for plain text.
    assert tok.encode("Hello world!") == [9707, 1879, 0]


def test_chat_template_renders_tools_tool_calls_and_thinking(tiny_engine):
    tok = tiny_engine.tokenizer
    tools = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "ok",
            "reasoning_content": "think first",
            "tool_calls": [
                {"type": "function", "function": {"name": "shell", "arguments": '{"command": "ls"}'}}
            ],
        },
        {"role": "tool", "content": "a.txt"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in text and '"name": "shell"' in text
    assert '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call>' in text
    assert "<think>\nthink first\n</think>" in text
    assert "<tool_response>\na.txt\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
