"""A fresh gateway loads what its hot path needs while it starts, and says when it is ready (`GET /_polar/ready`,
what `gateway_processes.start_gateway` waits on) — instead of holding the first model calls while tokens mode
loads the engine's tokenizer and chat template."""

from __future__ import annotations

import asyncio
import uuid

import httpx

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.gateway.prompts import PromptBuilder
from polar_mitm.gateway.token_chains import NO_CHAIN
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import read_all


def test_tokens_mode_is_ready_once_its_renderer_is_loaded(tiny_model_dir):
    builder = PromptBuilder("tokens", tokenizer=str(tiny_model_dir))
    assert builder.readiness() == (False, "loading the engine's tokenizer and chat template")
    asyncio.run(builder.warm())
    ready, detail = builder.readiness()
    assert ready and detail == f"tokens mode, renderer from {tiny_model_dir}"


def test_nothing_to_wait_for_is_ready_at_once(tmp_path):
    assert PromptBuilder("messages").readiness() == (True, "messages mode")

    unavailable = PromptBuilder("tokens", tokenizer=str(tmp_path / "missing"))
    asyncio.run(unavailable.warm())
    ready, detail = unavailable.readiness()
    assert ready and detail.startswith("messages mode: tokens mode unavailable: tokenizer path")

    async def engine_down() -> dict:
        raise ConnectionRefusedError("engine down")

    no_engine = PromptBuilder("tokens", model_info=engine_down)
    asyncio.run(no_engine.warm())
    ready, detail = no_engine.readiness()
    assert ready and "engine not answering /model_info yet (engine down)" in detail


def test_start_gateway_returns_a_ready_gateway_whose_first_call_needs_no_load(engine_url, tmp_path):
    gateway = gateway_processes.start_gateway(
        engine_url, tmp_path / "flows", confdir=tmp_path / "conf", log=tmp_path / "gw.log"
    )
    try:
        answer = httpx.get(gateway.reverse_url + gateway_processes.GATEWAY_READY_PATH, timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json()["ready"] is True and answer.json()["prompt_mode"] == "tokens"
        assert answer.json()["detail"].startswith("tokens mode, renderer from ")
        base = SessionId(f"ready-{uuid.uuid4().hex[:8]}").base_url(gateway.reverse_url, "/v1")
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        assert httpx.post(f"{base}/chat/completions", json=body, timeout=120).is_success
    finally:
        gateway.stop()
    (row,) = read_all(tmp_path / "flows").to_pylist()
    assert (
        row["splice_reason"] == NO_CHAIN
    )  # the renderer was there: a chain's first call, not "not loaded yet"
