"""The gateway's control call (gateway/control.py): one gateway process kept across rollouts is pointed at the next
records folder and sampling options, with the old folder's records complete shards before the call answers; only
the process that started it (the token) can do that, and a refused call changes nothing."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.gateway.control import CONTROL_PATH, TOKEN_HEADER
from polar_mitm.storage.engine_info import ENGINE_FILE
from polar_mitm.storage.journal_format import JOURNAL_DIR
from polar_mitm.storage.records import read_all


@pytest.fixture
def gateway(engine_url, tmp_path):
    gw = gateway_processes.start_gateway(
        engine_url, tmp_path / "a", confdir=tmp_path / "conf", log=tmp_path / "gateway.log"
    )
    yield gw
    gw.stop()


def chat(gw: gateway_processes.GatewayProcess, session: str) -> None:
    client = OpenAI(base_url=f"{gw.reverse_url}/s/{session}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def control(gw: gateway_processes.GatewayProcess, body: dict, token: str | None) -> httpx.Response:
    headers = {TOKEN_HEADER: token} if token is not None else {}
    return httpx.post(f"{gw.reverse_url}{CONTROL_PATH}", json=body, headers=headers, trust_env=False)


def test_switch_moves_the_records_folder_and_options_in_the_same_process(gateway, tmp_path):
    pid = gateway.proc.pid
    chat(gateway, "s1")
    chat(gateway, "s1")
    gateway.switch(tmp_path / "b", {"polar_temperature": "0.25"})
    # The old folder: complete shards, no journal left, numbering gap-free.
    assert not list((tmp_path / "a" / JOURNAL_DIR).glob("*.polarj"))
    old = read_all(tmp_path / "a", include_journal=False).to_pylist()
    assert [r["seq"] for r in old] == [0, 1] and {r["temperature"] for r in old} == {1.0}
    assert (tmp_path / "b" / ENGINE_FILE).exists()  # merge needs no --tokenizer for the new folder either
    chat(gateway, "s2")
    new = read_all(tmp_path / "b").to_pylist()
    assert [(r["session_id"], r["seq"], r["temperature"]) for r in new] == [("s2", 0, 0.25)]
    assert gateway.proc.pid == pid and gateway.proc.poll() is None
    assert len(read_all(tmp_path / "a").to_pylist()) == 2  # nothing of the new calls went to the old folder


@pytest.mark.parametrize(
    ("body", "token", "status"),
    [
        ({"options": {"polar_out": "X"}}, None, 403),  # no token
        ({"options": {"polar_out": "X"}}, "wrong", 403),
        ({"options": {"listen_port": 1}}, "TOKEN", 400),  # only the gateway's own options
        ({"options": {"polar_out": "X", "polar_temperature": "hot"}}, "TOKEN", 400),  # refused whole
        ({"out": "X"}, "TOKEN", 400),
    ],
)
def test_a_refused_control_call_changes_nothing(gateway, tmp_path, body, token, status):
    chat(gateway, "s1")
    for name, value in body.get("options", {}).items():
        if value == "X":
            body["options"][name] = str(tmp_path / "elsewhere")
    answer = control(gateway, body, gateway.control_token if token == "TOKEN" else token)
    assert answer.status_code == status, answer.text
    chat(gateway, "s1")
    assert [r["seq"] for r in read_all(tmp_path / "a").to_pylist()] == [0, 1]  # still writing to its folder
    assert not (tmp_path / "elsewhere").exists()
    assert gateway.control_token not in (tmp_path / "gateway.log").read_text()
