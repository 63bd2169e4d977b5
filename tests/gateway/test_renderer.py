"""The gateway's fast renderer (tokenizers + jinja2, loaded while the gateway starts) renders and tokenizes every
recorded test session exactly as transformers' `apply_chat_template` does — the engine's own rendering — for both
of the project's chat templates."""

from __future__ import annotations

import json

import pytest

from polar_mitm.gateway.bpe import TiktokenBPE, unsupported
from polar_mitm.gateway.renderer import (
    FastRenderer,
    PromptRenderer,
    TokenizersEncoder,
    TransformersRenderer,
    load_encoder,
)
from tests.gateway.sample_sessions import TEMPLATES, engine_requests, tokenizer_with_template


@pytest.fixture(scope="module", params=TEMPLATES)
def renderers(request, tiny_model_dir, tmp_path_factory):
    folder = tokenizer_with_template(tiny_model_dir, request.param, tmp_path_factory.mktemp(request.param))
    return PromptRenderer.load(str(folder)), TransformersRenderer.load(folder)


def test_a_tokenizer_json_folder_loads_the_fast_renderer(tiny_model_dir):
    renderer = PromptRenderer.load(str(tiny_model_dir))
    assert isinstance(renderer, FastRenderer)  # no transformers import at gateway start (bench_cold_start.py)
    assert isinstance(renderer.encoder, TiktokenBPE)  # Qwen's byte-level BPE: tiktoken is exact for it
    reference = TransformersRenderer.load(tiny_model_dir)
    assert (renderer.eot_id, renderer.eot_text) == (reference.eot_id, reference.eot_text)


TRICKY_TEXTS = [
    "plain words, then  two spaces\n\n\tand tabs   \n",
    "e\u0301 vs \u00e9 (NFC), 数字123456 and ünïcödé, emoji 🧪🧪",
    '<tool_call>\n{"name": "x"}\n</tool_call><|im_end|>\n<|im_start|>user\n<think>hmm</think>',
    "it's they'RE we'll  x<|im_end|><|im_end|>trailing<|endoftext|>",
    "",
]


def test_tiktoken_encodes_like_the_tokenizers_library(tiny_model_dir):
    fast = FastRenderer.load(tiny_model_dir)
    reference = TokenizersEncoder(tiny_model_dir / "tokenizer.json")
    for text in TRICKY_TEXTS:
        assert fast.encode(text) == reference.encode(text), text


def test_a_tokenizer_tiktoken_cannot_reproduce_is_run_by_the_tokenizers_library(tiny_model_dir, tmp_path):
    data = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert unsupported(data) == "normalizer Lowercase"
    encoder = load_encoder(tmp_path / "tokenizer.json")
    assert isinstance(encoder, TokenizersEncoder) and encoder.encode("ABC") == encoder.encode("abc")


def test_fast_rendering_equals_transformers_on_every_recorded_session(renderers):
    fast, reference = renderers
    seen = set()
    for source, _session, request in engine_requests():
        text = fast.render(request)
        assert text == reference.render(request), source
        ids = reference.tokenizer.apply_chat_template(
            request["messages"],
            tools=request.get("tools") or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert fast.encode(text) == list(ids), source
        seen.add(source)
    assert {"sdk_sessions", "claude-code", "codex", "gemini", "opencode", "pi", "qwen"} <= seen


def test_tokenizing_only_the_tail_after_an_end_of_turn_equals_tokenizing_the_whole(renderers):
    """What tokens mode relies on: a prompt splits after the end-of-turn that closes the previous assistant turn
    into a head and a tail that tokenize, apart, to the ids of the whole (checked on every recorded call)."""
    fast, _reference = renderers
    previous: dict[str, str] = {}
    split = 0
    for _source, session, request in engine_requests():
        text = fast.render(request)
        tip = previous.get(session)
        previous[session] = text
        if tip is None or not text.startswith(tip):
            continue
        cut = text.find(fast.eot_text, len(tip))
        if cut < 0:
            continue
        cut += len(fast.eot_text)
        assert fast.encode(text[:cut]) + fast.encode(text[cut:]) == fast.encode(text)
        split += 1
    assert split >= 10  # the recorded sessions do continue their conversations
