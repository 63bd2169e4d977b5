"""The Engines page's first-token ticks from real records: two calls through the session's gateway to the embedded
engine, one answered whole and one streamed. The whole answer's record keeps the engine's queue and prefill
seconds, so its call gets a first token inside it; the streamed one's keeps no engine timing, so it gets none."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx

from polar_mitm.dashboard import timeline
from polar_mitm.session_ids import SessionId


def ask(gateway, session: str, stream: bool) -> None:
    url = SessionId(session).base_url(gateway.reverse_url, "/v1/chat/completions")
    body = {"model": "m", "stream": stream, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream(
        "POST", url, json=body, headers={"authorization": "Bearer sk-x"}, timeout=120
    ) as answer:
        assert answer.status_code == 200, answer.read()
        answer.read()


def calls_of(run_dir: Path, session: str) -> list[dict]:
    deadline = time.monotonic() + 10
    while True:  # the record reaches the journal just after the answer
        lanes = timeline.engines(run_dir)["engines"]
        found = [c for lane in lanes for c in lane["calls"] if c["session_id"] == session]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_a_call_answered_whole_has_a_first_token_and_a_streamed_one_none(gateway, tmp_path):
    (tmp_path / "iter-0").mkdir()
    (tmp_path / "iter-0" / "flows").symlink_to(gateway.out_dir)  # the gateway's records, as an iteration's
    whole, streamed = f"whole-{uuid.uuid4().hex[:6]}", f"streamed-{uuid.uuid4().hex[:6]}"
    ask(gateway, whole, stream=False)
    ask(gateway, streamed, stream=True)
    [answered] = calls_of(tmp_path, whole)
    assert answered["start"] < answered["first_token"] <= answered["end"]
    [call] = calls_of(tmp_path, streamed)
    assert call["first_token"] is None and call["end"] > call["start"]
