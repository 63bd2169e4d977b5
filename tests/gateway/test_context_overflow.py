"""A prompt over the engine's context → each provider's own "too long" error, worded as the harnesses match it.

Claude Code compacts and retries on `^prompt is too long: \\d+ tokens > \\d+ maximum$` (its shipped source);
Codex on the code `context_length_exceeded`; AI-SDK harnesses and Qwen Code on "maximum context length";
Gemini on Google's INVALID_ARGUMENT "input token count … exceeds the maximum".
"""

from __future__ import annotations

import json
import re

from polar_mitm.codecs import CODECS
from polar_mitm.engines.client import status_error

ENGINE_SAYS = json.dumps(
    {
        "object": "error",
        "type": "BadRequestError",
        "code": 400,
        "message": "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
    }
).encode()


def error_body(provider: str) -> tuple[int, dict]:
    answer = CODECS[provider].encode_error(status_error(400, ENGINE_SAYS))
    return answer.status, json.loads(answer.body)


def test_anthropic_overflow_matches_claude_codes_compaction_trigger():
    status, body = error_body("anthropic")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert re.match(r"^prompt is too long: \d+ tokens > \d+ maximum$", body["error"]["message"])
    assert body["error"]["message"] == "prompt is too long: 9000 tokens > 8192 maximum"


def test_openai_overflow_has_the_code_and_wording():
    for provider in ("openai_chat", "openai_responses"):
        status, body = error_body(provider)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert "maximum context length is 8192 tokens" in body["error"]["message"]
        assert "resulted in 9000 tokens" in body["error"]["message"]


def test_google_overflow_is_invalid_argument_with_counts():
    status, body = error_body("google")
    assert status == 400 and body["error"]["status"] == "INVALID_ARGUMENT"
    assert (
        "input token count (9000) exceeds the maximum number of tokens allowed (8192)"
        in body["error"]["message"]
    )


def test_other_engine_errors_keep_their_message():
    answer = CODECS["anthropic"].encode_error(status_error(400, b'{"message": "bad top_p"}'))
    assert json.loads(answer.body)["error"]["message"] == "bad top_p"
