"""`read_session` (storage/records.py): one session's records from shards and live journals alike, as the rollout
service reads them when each session ends — the same rows `read_all` has for that session, in the same order."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.compute as pc

from polar_mitm.storage.records import read_all, read_session

SAMPLE = Path(__file__).resolve().parents[2] / "sample_flows" / "records"


def test_each_session_reads_as_read_all_has_it(tmp_path):
    folder = tmp_path / "flows"
    shutil.copytree(SAMPLE, folder)
    everything = read_all(folder)
    sessions = sorted(set(everything["session_id"].to_pylist()))
    assert len(sessions) > 1
    for session in sessions:
        expected = everything.filter(pc.equal(everything["session_id"], session))
        got = read_session(folder, session)
        assert got.num_rows == expected.num_rows > 0
        assert got["request_id"].to_pylist() == expected["request_id"].to_pylist()
    assert read_session(folder, "no-such-session").num_rows == 0
    assert read_session(tmp_path / "missing", sessions[0]).num_rows == 0
