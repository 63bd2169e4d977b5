"""The gateway's fast renderer (tokenizers + jinja2, loaded while the gateway starts) renders and tokenizes every
recorded test session exactly as transformers' `apply_chat_template` does — the engine's own rendering — for both
of the project's chat templates."""

from __future__ import annotations

import time

import pytest

from polar_mitm.gateway.renderer import FastRenderer, PromptRenderer, TransformersRenderer
from tests.gateway.sample_sessions import TEMPLATES, engine_requests, tokenizer_with_template


@pytest.fixture(scope="module", params=TEMPLATES)
def renderers(request, tiny_model_dir, tmp_path_factory):
    folder = tokenizer_with_template(tiny_model_dir, request.param, tmp_path_factory.mktemp(request.param))
    return PromptRenderer.load(str(folder)), TransformersRenderer.load(folder)


def test_a_tokenizer_json_folder_loads_the_fast_renderer_quickly(tiny_model_dir):
    started = time.perf_counter()
    renderer = PromptRenderer.load(str(tiny_model_dir))
    assert isinstance(renderer, FastRenderer)
    assert time.perf_counter() - started < 2.0  # transformers' import alone takes longer
    reference = TransformersRenderer.load(tiny_model_dir)
    assert (renderer.eot_id, renderer.eot_text) == (reference.eot_id, reference.eot_text)


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
