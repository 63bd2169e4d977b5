"""A weight push in the middle of a streamed call (issue 43): the embedded engine swaps the weights between two
tokens, the harness's stream (the openai SDK's) goes on unbroken, and the one record says which version sampled
which tokens — the tokens after the push carry exactly the new weights' logprobs."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from polar_mitm.agent.sdk_agent import join_chat_stream
from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.engines.weights import push_weights
from polar_mitm.processes import children
from polar_mitm.session_ids import SessionId
from tests.gateway.test_streaming_live import API_KEY, SCRIPT, SYSTEM, USER_TEXT, _engine, _gateway, _records


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    """The scripted tiny engine at 0.1 s a token, and a gateway in front of it."""
    proc, url = _engine(tmp_path_factory, "push-engine", ["--token-delay", "0.1"])
    gw = _gateway(tmp_path_factory, "gw-push", url)
    yield url, gw
    gw.stop()
    children.stop(proc)


def fresh_logprobs(model_dir, ids: list[int], start: int, temperature: float) -> torch.Tensor:
    """Logprobs of ids[start:] after ids[:start] under the weights in `model_dir` (one plain forward pass)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : -1] / temperature, dim=-1)
    return logp.gather(1, torch.tensor(ids[start:]).unsqueeze(1)).squeeze(1)


def test_a_push_mid_stream_splits_one_record_into_two_versions(paced):
    import openai

    engine_url, gw = paced
    new_weights = resolve_model("tiny", seed=1)
    session = f"push-{uuid.uuid4().hex[:6]}"
    client = openai.OpenAI(api_key=API_KEY, base_url=SessionId(session).base_url(gw.reverse_url, "/v1"))
    stream = client.chat.completions.create(
        model="gpt-4.1",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TEXT}],
        stream=True,
        temperature=1.0,
        logprobs=True,
    )
    chunks, pushed, seen_at_push = [], {}, []
    pusher = None
    for chunk in stream:
        chunks.append(chunk)
        texts = [c for c in chunks if c.choices and (c.choices[0].delta.content or "")]
        if pusher is None and len(texts) == 3:
            seen_at_push.append(len(chunks))
            pusher = threading.Thread(target=lambda: pushed.update(v=push_weights(engine_url, new_weights)))
            pusher.start()
    assert pusher is not None
    pusher.join(60)
    content, _ = join_chat_stream(chunks)
    assert (
        content == SCRIPT[0]["text"].split("</think>\n\n")[1]
    )  # the harness's stream, unbroken, not repeated

    [row] = _records(gw, session)
    spans = row["version_spans"]
    assert [s["version"] for s in spans] == [row["weight_version"], pushed["v"]] and spans[0]["start"] == 0
    k = spans[1]["start"]
    n = len(row["completion_ids"])
    assert 0 < k < n and len(row["completion_logprobs"]) == n
    ids = row["prompt_ids"] + row["completion_ids"]
    start = len(row["prompt_ids"])
    recorded = torch.tensor(row["completion_logprobs"])
    after = fresh_logprobs(new_weights, ids, start + k, row["temperature"])
    assert float((recorded[k:] - after).abs().max()) <= 1e-5
    before = fresh_logprobs(resolve_model("tiny"), ids[: start + k], start, row["temperature"])
    assert float((recorded[:k] - before).abs().max()) <= 1e-5
