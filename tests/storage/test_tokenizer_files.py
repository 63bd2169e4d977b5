"""A checkpoint's tokenizer with its added tokens in the config loads as the same tokenizer transformers builds
without them (storage/tokenizer_files.py): the tiny model's and SmolLM2's, from a tokenizer or from tokenizer.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.storage.tokenizer_files import (
    ADDED_TOKENS_KEY,
    CONFIG_FILE,
    keep_added_tokens_in_config,
    save_tokenizer,
)

TOOLS = [
    {"type": "function", "function": {"name": "shell", "parameters": {"type": "object", "properties": {}}}}
]
MESSAGES = [
    {"role": "system", "content": "Stop at <|im_end|> or <|endoftext|>; think in <think>…</think>."},
    {"role": "user", "content": 'héllo wörld 🎉 <tool_call>{"name": "x"}</tool_call>'},
]


def without_added_tokens(model_dir: Path, copy: Path) -> Path:
    """The checkpoint's tokenizer files as transformers 5 saves them: no added tokens in the config."""
    copy.mkdir()
    for name in ("tokenizer.json", CONFIG_FILE, "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, copy / name)
    config = json.loads((copy / CONFIG_FILE).read_text())
    config.pop(ADDED_TOKENS_KEY, None)
    (copy / CONFIG_FILE).write_text(json.dumps(config))
    return copy


def assert_same_tokenizer(fast, plain) -> None:
    assert fast.added_tokens_decoder == plain.added_tokens_decoder and fast.added_tokens_decoder
    assert fast.all_special_tokens == plain.all_special_tokens
    assert (fast.eos_token_id, fast.pad_token_id) == (plain.eos_token_id, plain.pad_token_id)
    ids = plain.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    assert fast.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=True, add_generation_prompt=True) == ids
    text = MESSAGES[0]["content"] + MESSAGES[1]["content"]
    assert fast(text)["input_ids"] == plain(text)["input_ids"]
    assert fast.decode(ids) == plain.decode(ids)


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_a_built_model_keeps_its_added_tokens_and_loads_the_same_tokenizer(model, tmp_path):
    model_dir = resolve_model(model)
    assert ADDED_TOKENS_KEY in json.loads((model_dir / CONFIG_FILE).read_text())
    plain_dir = without_added_tokens(model_dir, tmp_path / "plain")
    assert_same_tokenizer(AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(plain_dir))


def test_added_tokens_from_tokenizer_json_equal_a_loaded_tokenizers(tiny_model_dir, tmp_path):
    from_file = without_added_tokens(tiny_model_dir, tmp_path / "from-file")
    assert keep_added_tokens_in_config(from_file)
    assert not keep_added_tokens_in_config(from_file)  # there already: left as is
    from_tokenizer = tmp_path / "from-tokenizer"
    save_tokenizer(
        AutoTokenizer.from_pretrained(without_added_tokens(tiny_model_dir, tmp_path / "p")), from_tokenizer
    )
    written = [
        json.loads((d / CONFIG_FILE).read_text())[ADDED_TOKENS_KEY] for d in (from_file, from_tokenizer)
    ]
    assert written[0] == written[1]
    assert_same_tokenizer(
        AutoTokenizer.from_pretrained(from_file), AutoTokenizer.from_pretrained(tmp_path / "p")
    )


def test_a_folder_without_tokenizer_files_is_left_alone(tmp_path):
    assert not keep_added_tokens_in_config(tmp_path)
    (tmp_path / CONFIG_FILE).write_text("{}")
    assert not keep_added_tokens_in_config(tmp_path)  # no tokenizer.json to read them from
    assert json.loads((tmp_path / CONFIG_FILE).read_text()) == {}


def test_a_cached_build_from_before_gets_its_added_tokens_when_resolved(tiny_model_dir, tmp_path):
    from polar_mitm.engine.tiny_model import ensure_tiny_model

    cached = tmp_path / "tiny-qwen3-seed0"
    shutil.copytree(tiny_model_dir, cached)
    config = json.loads((cached / CONFIG_FILE).read_text())
    del config[ADDED_TOKENS_KEY]
    (cached / CONFIG_FILE).write_text(json.dumps(config))
    weights = (cached / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(cached) == cached  # up to date: not rebuilt ...
    assert (cached / "model.safetensors").stat().st_mtime_ns == weights
    assert ADDED_TOKENS_KEY in json.loads((cached / CONFIG_FILE).read_text())  # ... but its config upgraded
