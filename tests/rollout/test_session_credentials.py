"""A session cannot write into another session (issue 36 item 10).

A real rollout (the runner, a `cmd:` harness that is a hostile Python script) against a real gateway started as a
rollout starts it: with a session key, so every session's base URL, proxy URL and API key carry a credential. The
script makes one honest call, then tries to be someone else in every form the gateway reads: headers on its own URL,
the other session's path prefix, its own credential under the other's ids, the other's API key, the other's proxy
user name. Before this, all of them were answered and recorded under the victim's ids.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys

import pytest

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig
from polar_mitm.storage.records import read_all
from polar_mitm.tasks.task_file import Task

pytestmark = pytest.mark.slow

HOSTILE = r"""
import json, os, re, sys
import httpx

base = os.environ["POLAR_BASE_URL"]  # http://127.0.0.1:PORT/t/TASK/s/SESSION/c/CRED
root, task, own, cred = re.match(r"(http://[^/]+)/t/([^/]+)/s/([^/]+)/c/([0-9a-f]{32})$", base).groups()
victim = "victim-0-abcdef"
body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
chat = "/v1/chat/completions"
proxy_host = os.environ["POLAR_PROXY_URL"].rsplit("@", 1)[1]
attempts = {
    "own": dict(url=base + chat),
    "own_url_other_headers": dict(url=base + chat, headers={"x-polar-session": victim, "x-polar-task": "t-victim"}),
    "other_path": dict(url=f"{root}/t/{task}/s/{victim}{chat}"),
    "own_credential_other_ids": dict(url=f"{root}/t/{task}/s/{victim}/c/{cred}{chat}"),
    "other_api_key": dict(url=root + chat, headers={"authorization": f"Bearer polar-{task}/{victim}"}),
    "other_credential_key": dict(url=root + chat, headers={"authorization": f"Bearer polarc-{cred}-{task}/{victim}"}),
    "headers_only": dict(url=root + chat, headers={"x-polar-session": victim, "x-polar-task": task}),
}
statuses = {}
for name, call in attempts.items():
    answer = httpx.post(call["url"], json=body, headers=call.get("headers", {}), timeout=60)
    statuses[name] = answer.status_code
# The proxy listener, plain HTTP through it, as another session's proxy user (and with our credential).
for name, password in (("other_proxy_user", "x"), ("other_proxy_user_own_credential", cred)):
    proxy = f"http://{task}%2F{victim}:{password}@{proxy_host}"
    with httpx.Client(proxy=proxy, timeout=60) as client:
        statuses[name] = client.post("http://api.openai.com" + chat, json=body).status_code
with open(sys.argv[1], "w") as out:
    json.dump({"own": own, "statuses": statuses}, out)
open("out.txt", "w").write("hello")
"""


def test_a_session_cannot_be_another_session_in_any_form_the_gateway_reads(scripted_engine_url, tmp_path):
    # The script comes with the workspace and writes its findings there: the session runs in its sandbox.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "hostile.py").write_text(HOSTILE)
    gw = gateway_processes.start_gateway(
        scripted_engine_url,
        tmp_path / "flows",
        confdir=tmp_path / "conf",
        log=tmp_path / "gateway.log",
        session_key=secrets.token_urlsafe(32),
    )
    try:
        config = RolloutConfig(
            workspace_root=tmp_path / "ws", log_dir=tmp_path / "logs", group_size=1, keep_workspaces=True
        )
        harness = HarnessSpec(f"cmd:{sys.executable} hostile.py results.json")
        task = Task(
            task_id="t-attacker", prompt="p", eval_command="test -f out.txt", workspace_dir=tmp_path / "src"
        )
        summary = asyncio.run(Rollout([task], harness, GatewayEndpoints.of(gw), config).run())
    finally:
        gw.stop()
    assert [s.status for s in summary.sessions] == ["ok"], (tmp_path / "logs").glob("*")
    found = json.loads((summary.sessions[0].workspace / "results.json").read_text())
    statuses = found.pop("statuses")
    assert statuses.pop("own") == 200 and statuses.pop("own_url_other_headers") == 200
    assert statuses == dict.fromkeys(statuses, 401) and len(statuses) == 7, statuses
    rows = read_all(gw.out_dir).to_pylist()
    # Both answered calls are the attacker's own, whatever its headers said; nothing under the victim's ids.
    assert [(r["session_id"], r["task_id"]) for r in rows] == [(found["own"], "t-attacker")] * 2
    assert found["own"] == summary.sessions[0].session_id
    # The credential reaches no log line.
    credential = GatewayEndpoints.of(gw).session_id(found["own"], "t-attacker").credential
    assert credential and credential not in (tmp_path / "gateway.log").read_text()


def test_a_gateway_started_without_a_session_key_still_serves_plain_ids(gateway):
    """`polar-mitm gateway` by hand, harness presets and tests: sessions named by ids alone keep working."""
    import httpx

    from polar_mitm.session_ids import SessionId

    url = SessionId("plain-1", "t").base_url(gateway.reverse_url, "/v1/chat/completions")
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url, json=body, timeout=60).status_code == 200
