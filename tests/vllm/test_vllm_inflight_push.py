"""A weight push in the middle of a streamed call on vLLM (issue 43): the push pauses vLLM with the call kept
(`/pause?mode=keep`), so it neither waits for the call nor breaks it; the harness's stream (the openai SDK's) goes
on, and the one record says — from vLLM's own account (`/inference/v1/generate`'s `weight_versions`) — which
tokens each version sampled: those before the push are the old weights' exactly, those after are the new weights'."""

from __future__ import annotations

import json
import threading
import time
import uuid

import openai
import pytest

from polar_mitm.engines import weights
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.session_ids import SessionId
from polar_mitm.vllm.server import resolve_vllm_model
from tests.vllm.test_vllm import LOGPROB_TOLERANCE, max_gap, session_records

SAMPLED = (
    3000  # vLLM samples the tiny model at ~150 tokens/s here: a push sent at the first chunk lands inside
)


@pytest.fixture(scope="module")
def long_gateway(vllm_url, tmp_path_factory):
    """A gateway in front of the session's vLLM that lets a call sample `SAMPLED` tokens."""
    root = tmp_path_factory.mktemp("vllm-push-gateway")
    options = {"polar_temperature": "1.0", "polar_max_tokens": str(SAMPLED), "polar_engine": "auto"}
    with gateway_processes.gateway_running(
        vllm_url, root / "flows", confdir=root / "conf", log=root / "gateway.log", options=options
    ) as gateway:
        yield gateway


def test_a_push_mid_stream_on_vllm_keeps_the_call_and_splits_its_record(
    vllm_url, vllm_model_dir, vllm_reference, long_gateway
):
    new_weights = resolve_vllm_model("tiny", seed=1)
    session = f"vpush-{uuid.uuid4().hex[:6]}"
    client = openai.OpenAI(
        api_key="sk-polar",
        base_url=SessionId(session).base_url(long_gateway.reverse_url, "/v1"),
        max_retries=0,
    )
    chunks, pushed, pusher = [], {}, None
    started = time.monotonic()
    try:
        for chunk in client.chat.completions.create(
            model="gpt-4.1",
            messages=[{"role": "user", "content": "Tell me a long story."}],
            stream=True,
            max_tokens=SAMPLED,
        ):
            chunks.append(chunk)
            if pusher is None and len(chunks) == 1:
                pusher = threading.Thread(
                    target=lambda: pushed.update(r=weights.push_weights_reported(vllm_url, new_weights))
                )
                pusher.start()
        call_seconds = time.monotonic() - started
        assert pusher is not None
        pusher.join(120)
        report = pushed["r"]
        assert report.mode == "keep" and 0 < report.pause_seconds < call_seconds

        [row] = session_records(long_gateway, session)
        assert row["error"] is None, row["error"]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == json.loads(row["response_json"])["choices"][0]["message"]["content"]
        spans, n = row["version_spans"], len(row["completion_ids"])
        assert [s["version"] for s in spans] == [row["weight_version"], report.weight_version]
        k = spans[1]["start"]
        assert spans[0]["start"] == 0 and 0 < k < n
        recorded = row["completion_logprobs"]
        prompt, sampled = row["prompt_ids"], row["completion_ids"]
        assert max_gap(recorded[:k], vllm_reference(prompt, sampled[:k])) <= LOGPROB_TOLERANCE
        # After the push the new weights sample — their numbers exactly (measured 1e-6 on this CPU build: the kept
        # call's context is not scored by the old weights' cache), not the old weights'.
        after = sampled[k : k + 50]
        assert (
            max_gap(recorded[k : k + 50], vllm_reference(prompt + sampled[:k], after, new_weights))
            <= LOGPROB_TOLERANCE
        )
        assert max_gap(recorded[k : k + 50], vllm_reference(prompt + sampled[:k], after)) > 1e-2
    finally:
        weights.push_weights(vllm_url, vllm_model_dir)  # the session's other tests score the original weights
