"""The official SDKs through the real gateway (mitmdump + addon) in both hook-up modes, plain and streaming.

Each case is a two-turn, tool-using exchange against the scripted tiny engine: turn 1 the model calls `shell`,
turn 2 (after the tool result) it answers. Then the records are checked against what the client received.
"""

from __future__ import annotations

import json
import uuid

import pytest

from polar_mitm.agent.sdk_agent import DRIVERS, base_url_for
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.records import read_all

API_KEY = "sk-polar-test-SECRET-7f3a9c"
USER_TEXT = "Write hello into out.txt"
FINAL_TEXT = "Done: out.txt now says hello."


def run(provider, gateway, mode, session, task, stream):
    prefix = SessionId(session, task).path_prefix
    base = base_url_for(provider, gateway.reverse_url, prefix) if mode == "reverse" else None
    result = DRIVERS[provider](USER_TEXT, api_key=API_KEY, base_url=base, stream=stream)
    assert result.calls == 2 and result.tool_commands == ["echo hello > out.txt"]
    return result.final_text


def session_records(gateway, session):
    table = read_all(gateway.out_dir)
    rows = [r for r in table.to_pylist() if r["session_id"] == session]
    return sorted(rows, key=lambda r: r["seq"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("mode", ["proxy", "reverse"])
@pytest.mark.parametrize("provider", list(DRIVERS))
def test_sdk_two_turn_tool_session_is_answered_and_recorded(
    gateway, proxy_env, tiny_engine, provider, mode, stream
):
    session, task = f"{provider}-{mode}-{uuid.uuid4().hex[:8]}", f"task-{provider}"
    if mode == "proxy":
        proxy_env(session, task)
    final_text = run(provider, gateway, mode, session, task, stream)
    assert final_text.strip() == FINAL_TEXT

    rows = session_records(gateway, session)
    assert [r["seq"] for r in rows] == [0, 1]
    tok = tiny_engine.tokenizer
    for r in rows:
        assert r["provider"] == provider and r["stream"] is stream and r["task_id"] == task
        assert r["session_source"] == ("proxy_auth" if mode == "proxy" else "path")
        assert r["mode"] == ("regular" if mode == "proxy" else "reverse")
        assert r["error"] is None and r["status_code"] == 200
        assert len(r["completion_logprobs"]) == len(r["completion_ids"]) > 0
        assert all(lp <= 0 for lp in r["completion_logprobs"])
        assert r["prompt_tokens"] == len(r["prompt_ids"]) and r["weight_version"] is not None
        assert r["model_used"] == "tiny" and r["model_requested"]
    first, second = rows
    assert first["finish_reason"] == "tool_calls" and second["finish_reason"] == "stop"
    assert '"name": "shell"' in tok.decode(first["completion_ids"])
    assert tok.decode(second["completion_ids"], skip_special_tokens=True) == final_text
    # The follow-up carries the tool result, and the first prompt is an exact token prefix of the second.
    assert any(m["role"] == "tool" for m in json.loads(second["messages_json"]))
    assert second["prompt_ids"][: len(first["prompt_ids"])] == first["prompt_ids"]
    assert json.loads(first["tools_json"])[0]["name"] == "shell"


def test_no_secret_reaches_records_or_logs(gateway, proxy_env):
    proxy_env("secret-check")
    run("openai_chat", gateway, "proxy", "secret-check", None, False)
    run("anthropic", gateway, "reverse", "secret-check-2", "t", True)
    table = read_all(gateway.out_dir)
    for column in table.column_names:
        if str(table.schema.field(column).type) == "string":
            assert not any(API_KEY in (v or "") for v in table[column].to_pylist()), column
    assert API_KEY not in gateway.log.read_text()
