"""The scripted test policy on vLLM (polar_mitm/vllm/scripted.py): vLLM writes the script's turns while every
logprob it reports stays the model's own — where vLLM's own forcing (`allowed_token_ids`, like any logits processor
or grammar) reports log p = 0 for the forced token.

The session's vLLM server plays a script only inside `vllm_script` blocks (tests/vllm/conftest.py); each call is
checked against transformers on the same checkpoint at the call's temperature.
"""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from tests.engines import keyed

LOGPROB_TOLERANCE = 1e-4  # fp32 on CPU (measured ≤ 1e-6)
TOOL = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}
TURN = {"text": "Listing.", "tool_call": {"name": "shell", "arguments": {"command": "ls"}}}
SIDE = "A short title."


@pytest.fixture(scope="module")
def tokenizer(vllm_model_dir):
    return AutoTokenizer.from_pretrained(vllm_model_dir)


@pytest.fixture(scope="module")
def served(vllm_url) -> str:
    return keyed.get(f"{vllm_url}/v1/models", timeout=30).json()["data"][0]["id"]


def chat_prompt(tokenizer, tools: list | None = None) -> list[int]:
    messages = [{"role": "user", "content": "List the files."}]
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False)


def complete(vllm_url: str, served: str, prompt: list[int], **sampling) -> tuple[list[int], list[float]]:
    """One token-in call (what the gateway sends in tokens mode): the sampled ids and their reported logprobs."""
    body = {"model": served, "prompt": prompt, "max_tokens": 64, "logprobs": 0, "return_token_ids": True}
    choice = keyed.post(f"{vllm_url}/v1/completions", json=body | sampling, timeout=120).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def scripted_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def test_vllms_own_forcing_reports_log_p_zero_for_the_forced_token(
    vllm_url, served, tokenizer, vllm_reference
):
    """Why the scripted policy does not force through the logits: vLLM's reported logprobs are taken after them."""
    prompt = chat_prompt(tokenizer)
    forced = tokenizer.encode("Hello", add_special_tokens=False)[0]
    ids, logprobs = complete(
        vllm_url, served, prompt, allowed_token_ids=[forced], max_tokens=3, temperature=1.0
    )
    model = vllm_reference(prompt, ids)
    print(f"allowed_token_ids forcing: reported {logprobs}, the model's {[round(x, 2) for x in model]}")
    assert ids == [forced] * 3
    assert logprobs == [0.0, 0.0, 0.0] and max(model) < -1.0


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5, "top_p": 0.5}])
def test_a_scripted_turn_is_written_with_the_models_own_logprobs(
    vllm_url, served, tokenizer, vllm_reference, vllm_script, sampling
):
    """The request offers the tool: the turn's text and call come out token for token, closed by the end of turn,
    each logprob the model's at the call's temperature — also under a top-k/top-p cut the forced tokens lie outside
    of (they were not drawn from it: SGLang's pre-cut semantics, which the trainer scores)."""
    prompt = chat_prompt(tokenizer, tools=[TOOL])
    with vllm_script({"turns": [TURN], "side": SIDE}):
        ids, logprobs = complete(vllm_url, served, prompt, **sampling)
    expected = 'Listing.\n<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call>'
    assert ids == scripted_ids(tokenizer, expected)
    model = vllm_reference(prompt, ids, temperature=sampling["temperature"])
    gap = max(abs(a - b) for a, b in zip(logprobs, model, strict=True))
    print(f"{sampling}: {len(ids)} scripted tokens, max |Δ logprob| vs transformers {gap:.1e}")
    assert gap <= LOGPROB_TOLERANCE
    free_ids, _ = complete(
        vllm_url, served, prompt, **sampling
    )  # the block is over: vLLM samples freely again
    assert free_ids != ids


def test_the_turn_follows_the_prompt_tools_side_requests_and_replies(
    vllm_url, served, tokenizer, vllm_script
):
    """As on the embedded engine: no tools offered → the side answer; a `replies` entry whose text is in the
    prompt wins; the second assistant turn in the prompt plays the script's second turn."""
    script = {
        "turns": [TURN, "All listed."],
        "side": SIDE,
        "replies": [{"when": "Summarise", "text": "A summary."}],
    }
    tools_prompt = chat_prompt(tokenizer, tools=[TOOL])
    messages = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "Listing."},
        {"role": "user", "content": "Go on."},
    ]
    second_turn = tokenizer.apply_chat_template(
        messages, tools=[TOOL], add_generation_prompt=True, return_dict=False
    )
    summary = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Summarise this session."}],
        add_generation_prompt=True,
        return_dict=False,
    )
    with vllm_script(script):
        side_ids, _ = complete(vllm_url, served, chat_prompt(tokenizer))
        second_ids, _ = complete(vllm_url, served, second_turn)
        reply_ids, _ = complete(vllm_url, served, summary)
        first_ids, _ = complete(vllm_url, served, tools_prompt)
    assert side_ids == scripted_ids(tokenizer, SIDE)
    assert second_ids == scripted_ids(tokenizer, "All listed.")
    assert reply_ids == scripted_ids(tokenizer, "A summary.")
    assert tokenizer.decode(first_ids).startswith("Listing.\n<tool_call>")


def test_a_choices_turn_picks_a_candidate_by_the_models_probability(
    vllm_url, served, tokenizer, vllm_reference, vllm_script
):
    """Two candidates that differ in one token: each seeded call writes one of them whole, with the model's
    logprobs, and the choice frequency matches the model's probabilities of the two tokens (renormalised)."""
    prompt = chat_prompt(tokenizer)
    candidates = ["The file says hello.", "The file says Hello."]
    ids = [scripted_ids(tokenizer, text) for text in candidates]
    fork = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    at_fork = vllm_reference(prompt + ids[0][:fork], [ids[0][fork]]) + vllm_reference(
        prompt + ids[1][:fork], [ids[1][fork]]
    )
    p_first = 1 / (1 + math.exp(at_fork[1] - at_fork[0]))
    calls = 40
    with vllm_script({"turns": [{"choices": candidates}]}):
        answers = [complete(vllm_url, served, prompt, temperature=1.0, seed=seed) for seed in range(calls)]
    picked = [ids.index(answer) for answer, _ in answers]  # ValueError: not a candidate
    for answer, logprobs in answers[:2]:
        model = vllm_reference(prompt, answer)
        assert max(abs(a - b) for a, b in zip(logprobs, model, strict=True)) <= LOGPROB_TOLERANCE
    share = picked.count(0) / calls
    sigma = math.sqrt(p_first * (1 - p_first) / calls)
    print(f"choice of candidate 1: {share:.2f} over {calls} calls, the model's {p_first:.2f} (σ {sigma:.2f})")
    assert abs(share - p_first) <= 4 * sigma + 1e-9
