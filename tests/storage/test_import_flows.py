"""`polar-mitm import-flows` on what really happens to flow files: mitmdump killed mid-write, one bad record.

The flows are recorded for real (the gateway in front of the tiny engine, saved with mitmproxy's `-w`), then cut
or edited with mitmproxy's own reader and writer, and imported by the real command.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pyarrow.parquet as pq
import pytest

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.session_ids import SessionId

POLAR = str(Path(sys.executable).with_name("polar-mitm"))
CALLS = 3


@pytest.fixture(scope="module")
def flow_file(engine_url, tmp_path_factory) -> Path:
    """Three chat calls through the gateway, saved by mitmproxy as `mitmdump -w FILE` saves them."""
    root = tmp_path_factory.mktemp("recorded")
    saved = root / "calls.flow"
    with gateway_processes.gateway_running(
        engine_url,
        root / "flows",
        confdir=root / "conf",
        log=root / "gw.log",
        options={"save_stream_file": str(saved)},
    ) as gw:
        client = openai.OpenAI(
            api_key="k", base_url=SessionId("flows").base_url(gw.reverse_url, "/v1"), max_retries=0
        )
        for i in range(CALLS):
            client.chat.completions.create(
                model="gpt", max_tokens=4, messages=[{"role": "user", "content": f"call {i}"}]
            )
    return saved


def read_flows(path: Path) -> tuple[list, list[int]]:
    """The flows of a file and the byte offset where each ends."""
    from mitmproxy import io

    flows, ends = [], []
    with open(path, "rb") as f:
        for flow in io.FlowReader(f).stream():
            flows.append(flow)
            ends.append(f.tell())
    return flows, ends


def import_flows(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [POLAR, "import-flows", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "COLUMNS": "200"},
    )


def imported_ids(out: Path) -> list[str]:
    return [r["request_id"] for r in pq.read_table(next(out.glob("records-*.parquet"))).to_pylist()]


@pytest.mark.parametrize("where", ["mid-flow", "in the length prefix", "before the last byte"])
def test_a_flow_file_cut_by_kill_9_imports_every_complete_flow(flow_file, tmp_path, where):
    flows, ends = read_flows(flow_file)
    assert len(flows) == CALLS
    cut_at = {
        "mid-flow": (ends[1] + ends[2]) // 2,
        "in the length prefix": ends[1] + 1,
        "before the last byte": ends[2] - 1,
    }[where]
    cut = tmp_path / "cut.flow"
    cut.write_bytes(flow_file.read_bytes()[:cut_at])
    result = import_flows(str(cut), "-o", str(tmp_path / "out"))
    said = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in said, said
    assert imported_ids(tmp_path / "out") == [f.metadata["polar_record"]["request_id"] for f in flows[:2]]
    assert f"{cut}: file truncated after 2 flows" in result.stderr, said
    assert "2 from gateway flows" in result.stdout and "1 not imported" in result.stdout, said


def test_one_flow_with_a_bad_record_does_not_keep_the_others_out(flow_file, tmp_path):
    from mitmproxy import io

    flows, _ = read_flows(flow_file)
    flows[1].metadata["polar_record"]["session_id"] = None
    flows[2].metadata["polar_record"]["prompt_ids"] = ["one", "two"]
    edited = tmp_path / "edited.flow"
    with open(edited, "wb") as f:
        writer = io.FlowWriter(f)
        for flow in flows:
            writer.add(flow)
    result = import_flows(str(edited), "-o", str(tmp_path / "out"))
    said = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in said, said
    assert imported_ids(tmp_path / "out") == [flows[0].metadata["polar_record"]["request_id"]]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, said
    assert f"flow 2 (id {flows[1].id})" in warnings[0] and "session_id" in warnings[0], said
    assert f"flow 3 (id {flows[2].id})" in warnings[1] and "prompt_ids" in warnings[1], said
    assert "1 from gateway flows" in result.stdout and "2 not imported" in result.stdout, said


def test_nothing_importable_exits_1_naming_why(flow_file, tmp_path):
    _, ends = read_flows(flow_file)
    cut = tmp_path / "cut.flow"
    cut.write_bytes(flow_file.read_bytes()[: ends[0] // 2])
    result = import_flows(str(cut), str(tmp_path / "missing.flow"), "-o", str(tmp_path / "out"))
    said = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in said, said
    assert f"{cut}: file truncated after 0 flows" in result.stderr, said
    assert f"{tmp_path / 'missing.flow'}: cannot be read" in result.stderr, said
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("records-*.parquet"))


@pytest.mark.parametrize("damage", ["overwritten", "inserted garbage ending in digits"])
def test_a_corrupt_region_mid_file_loses_only_the_flows_it_covers(flow_file, tmp_path, damage):
    flows, ends = read_flows(flow_file)
    data = flow_file.read_bytes()
    if damage == "overwritten":  # the second flow's bytes are noise: the first and third are imported
        middle = ends[0] + (ends[1] - ends[0]) // 3
        corrupt = data[:middle] + b"\x00garbage\xff" * 8 + data[middle + 80 :]
        expected = [flows[0], flows[2]]
    else:  # noise between the first and second flows, ending in digits right before the second's length
        corrupt = data[: ends[0]] + b"#\xfe noise 12:34" + data[ends[0] :]
        expected = flows
    damaged = tmp_path / "damaged.flow"
    damaged.write_bytes(corrupt)
    result = import_flows(str(damaged), "-o", str(tmp_path / "out"))
    said = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in said, said
    assert imported_ids(tmp_path / "out") == [f.metadata["polar_record"]["request_id"] for f in expected]
    assert f"{damaged}: corrupt data from byte {ends[0]} to " in result.stderr, said
    assert "reading resumed at the next intact flow" in result.stderr, said
    assert "1 not imported" in result.stdout, said
