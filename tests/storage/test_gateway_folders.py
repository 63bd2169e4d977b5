"""Issue 36 items 5 and 6 with real processes: the tiny engine, real gateways (mitmdump + addon) and the real
`polar-mitm records` / `merge` commands.

- `--gateways N` writes `out/gw-K` per gateway: every reader takes every gateway's live journal, a SIGKILLed
  gateway's included, and each acknowledged record once.
- One records folder, one gateway: a second gateway on a live gateway's folder refuses in one line (and the first's
  acknowledged records all survive); once the first stops or switches away, a new gateway can take the folder.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.journal_format import JOURNAL_DIR, JOURNAL_SUFFIX
from polar_mitm.storage.records import read_all

POLAR = str(Path(sys.executable).with_name("polar-mitm"))

pytestmark = pytest.mark.slow


def polar(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [POLAR, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PATH": "/usr/bin:/bin",
            "COLUMNS": "250",
        },
    )


def call(gateway: gateway_processes.GatewayProcess, session: str, n: int) -> list[str]:
    """`n` acknowledged chat calls of `session` through `gateway`; their answers' ids."""
    client = openai.OpenAI(
        api_key="k", base_url=SessionId(session).base_url(gateway.reverse_url, "/v1"), max_retries=0
    )
    return [
        client.chat.completions.create(
            model="gpt", max_tokens=3, messages=[{"role": "user", "content": f"{session} call {i}"}]
        ).id
        for i in range(n)
    ]


def recorded_calls(out: Path) -> list[tuple[str, int]]:
    table = read_all(out)
    return sorted(zip(table["session_id"].to_pylist(), table["seq"].to_pylist(), strict=True))


def test_every_reader_sees_a_killed_gateways_records_once(engine_url, tmp_path):
    out = tmp_path / "flows"
    gateways = gateway_processes.start_gateways(
        [engine_url, engine_url], out, confdir=tmp_path / "conf", log=tmp_path / "gw.log"
    )
    try:
        call(gateways[0], "on-gw0", 3)
        call(gateways[1], "on-gw1", 4)
    finally:
        gateways[1].kill()  # SIGKILL: its 4 acknowledged records are only in gw-1/_journal
        gateways[0].stop()  # compacts into gw-0's shard
    assert list((out / "gw-1" / JOURNAL_DIR).glob(f"*{JOURNAL_SUFFIX}")), "the killed gateway left no journal"
    expected = sorted([("on-gw0", i) for i in range(3)] + [("on-gw1", i) for i in range(4)])

    listed = polar("records", str(out), "--limit", "100")
    said = listed.stdout + listed.stderr
    assert listed.returncode == 0 and "Traceback" not in said, said
    assert "7 records in" in listed.stdout, said
    assert sorted(re.findall(r"(on-gw[01])\s.*?\s(\d+)\s", listed.stdout)) == [
        (s, str(q)) for s, q in expected
    ]

    merged = polar("merge", str(out), "-o", str(tmp_path / "merged"), "--builder", "per_request")
    said = merged.stdout + merged.stderr
    assert merged.returncode == 0 and "Traceback" not in said, said
    summary = json.loads((tmp_path / "merged" / "_summary.json").read_text())
    assert summary["records"] == 7 and summary["sessions"] == 2, summary

    # The folder's next gateway recovers the dead one's journal into a shard: still each record once.
    with gateway_processes.gateway_running(engine_url, out / "gw-1", confdir=tmp_path / "conf"):
        pass
    assert not list((out / "gw-1" / JOURNAL_DIR).glob(f"*{JOURNAL_SUFFIX}"))
    assert recorded_calls(out) == expected


def test_a_second_gateway_on_a_live_gateways_folder_refuses_and_loses_nothing(engine_url, tmp_path):
    out, conf = tmp_path / "flows", tmp_path / "conf"
    first = gateway_processes.start_gateway(engine_url, out, confdir=conf, log=tmp_path / "first.log")
    try:
        call(first, "first", 5)
        with pytest.raises(RuntimeError):
            gateway_processes.start_gateway(engine_url, out, confdir=conf, log=tmp_path / "second.log")
        refusal = [line for line in (tmp_path / "second.log").read_text().splitlines() if line.strip()]
        assert len(refusal) == 1 and str(out) in refusal[0] and "in use by another" in refusal[0], refusal
        assert "Traceback" not in refusal[0]
        call(first, "first", 2)  # the first goes on serving and recording
    finally:
        first.stop()
    assert recorded_calls(out) == [("first", i) for i in range(7)]
    # Stopped, it released the folder: the next gateway takes it and its numbering goes on.
    with gateway_processes.gateway_running(engine_url, out, confdir=conf) as third:
        call(third, "first", 1)
    assert recorded_calls(out) == [("first", i) for i in range(8)]


def test_the_folder_lock_moves_with_a_switch(engine_url, tmp_path):
    before, after, conf = tmp_path / "before", tmp_path / "after", tmp_path / "conf"
    gateway = gateway_processes.start_gateway(engine_url, before, confdir=conf)
    try:
        call(gateway, "moved", 2)
        gateway.switch(after)  # the old folder's journal is compacted, its lock released, the new one's taken
        call(gateway, "moved", 1)
        with pytest.raises(RuntimeError):
            gateway_processes.start_gateway(engine_url, after, confdir=conf, log=tmp_path / "refused.log")
        assert "in use by another" in (tmp_path / "refused.log").read_text()
        with gateway_processes.gateway_running(engine_url, before, confdir=conf) as successor:
            call(successor, "successor", 1)
    finally:
        gateway.stop()
    assert [s for s, _ in recorded_calls(before)] == ["moved", "moved", "successor"]
    assert [s for s, _ in recorded_calls(after)] == ["moved"]
