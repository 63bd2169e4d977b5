"""An engine's answer read into a Completion: the echo of the prompt ids sent is compared as bytes, never trusted."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from polar_mitm.conversation import Completion, without_echo

SENT = [151644, 8948, 198, 2610, 525, 264, 10657, 8315, 13, 151645, 198, 0, 1, 2**31 - 1]


def answer(prompt_ids: Any = SENT, *, content: str = "ok", meta: dict[str, Any] | None = None) -> dict:
    """An SGLang chat answer: two sampled ids with their logprobs."""
    return {
        "id": "chatcmpl-1",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
                "prompt_token_ids": prompt_ids,
                "response_token_ids": [5, 6],
                "meta_info": {
                    "weight_version": "3",
                    "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
                }
                | (meta or {}),
            }
        ],
    }


def read(raw: bytes) -> Completion:
    return Completion.from_engine_answer(raw, list(SENT), orjson.dumps(SENT))


def test_an_exact_echo_reads_as_the_ids_sent_and_the_rest_as_a_full_parse_does():
    raw = orjson.dumps(answer())
    assert without_echo(raw, orjson.dumps(SENT)) is not None  # the fast path is the one taken
    fast, full = read(raw), Completion.from_engine_response(orjson.loads(raw))
    assert fast == full and fast.prompt_ids == SENT


@pytest.mark.parametrize(
    ("echo", "why"),
    [
        ([*SENT, 7], "one id more"),
        (SENT[:-1], "one id fewer"),
        ([*SENT[:3], 9, *SENT[4:]], "one id changed"),
    ],
)
def test_an_echo_that_is_not_the_ids_sent_is_the_engines_own(echo, why):
    completion = read(orjson.dumps(answer(echo)))
    assert completion.prompt_ids == echo, why


def test_an_echo_formatted_otherwise_is_parsed_and_still_equal():
    raw = json.dumps(answer()).encode()  # ", " and ": " separators
    assert without_echo(raw, orjson.dumps(SENT)) is None
    assert read(raw).prompt_ids == SENT


def test_the_key_in_the_models_text_or_twice_in_the_answer_never_splices_the_wrong_one():
    decoy = f'"prompt_token_ids":{json.dumps(SENT, separators=(",", ":"))}'
    in_text = orjson.dumps(answer([1, 2, 3], content=decoy))
    assert read(in_text).prompt_ids == [1, 2, 3] and read(in_text).content == decoy
    twice = orjson.dumps(answer(meta={"prompt_token_ids": SENT}))
    assert without_echo(twice, orjson.dumps(SENT)) is None
    assert read(twice).prompt_ids == SENT


@pytest.mark.parametrize(
    "echo", [None, [], [1, -2, 3], [1, "2", 3], [1, 2.5], [True, 2], [2**31], {"a": 1}], ids=repr
)
def test_a_missing_or_malformed_echo_is_refused_as_before(echo):
    raw = orjson.dumps(answer(echo))
    with pytest.raises((ValueError, TypeError)):
        read(raw)


def test_a_malformed_answer_with_an_exact_echo_is_still_refused():
    bad = answer()
    bad["choices"][0]["response_token_ids"] = [5, -6]
    with pytest.raises(ValueError, match="response_token_ids"):
        read(orjson.dumps(bad))
