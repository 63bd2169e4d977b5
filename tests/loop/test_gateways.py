"""`--gateways N` (issue 28 item 3): several gateway processes per rollout, sessions spread across them.

One loop iteration of the CPU demo tasks through two gateways: each session's calls all go to one gateway (its
`seq` gap-free from 0, its records in one `gw-K` folder), both gateways get sessions, no record is lost or
duplicated, and merge and training take the iteration's folder whole. The two processes serve the whole run: the
final rollout goes through them too.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.loop import Loop
from polar_mitm.storage.records import read_all

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"

pytestmark = pytest.mark.slow


def test_two_gateways_share_one_iteration_without_losing_or_splitting_a_session(tmp_path):
    cfg = LoopConfig(
        tasks=EXAMPLES / "tasks.jsonl",
        run_dir=tmp_path / "run",
        iterations=1,
        group_size=2,
        concurrency=4,
        gateways=2,
        model="tiny",
        script=EXAMPLES / "policy.json",
        learning_rate=1e-2,
        max_tokens=128,
        final_rollout=True,
    )
    loop = Loop(cfg)
    stats = loop.run()[0]
    flows = cfg.run_dir / "iter-0" / "flows"
    folders = {gw.name: read_all(gw).to_pylist() for gw in sorted(flows.glob("gw-*"))}
    assert sorted(folders) == ["gw-0", "gw-1"] and all(folders.values()), {
        k: len(v) for k, v in folders.items()
    }
    where: dict[str, set[str]] = defaultdict(set)
    seqs: dict[str, list[int]] = defaultdict(list)
    for name, rows in folders.items():
        for row in rows:
            where[row["session_id"]].add(name)
            seqs[row["session_id"]].append(row["seq"])
    everything = read_all(flows).to_pylist()
    assert len(everything) == sum(map(len, folders.values())) == stats.requests
    assert len({r["request_id"] for r in everything}) == len(everything)  # none duplicated
    rewarded = {
        r["session_id"] for r in pq.read_table(cfg.run_dir / "iter-0" / "rewards.parquet").to_pylist()
    }
    assert set(where) == rewarded and len(rewarded) == 6  # every session's calls recorded
    assert all(len(gateways) == 1 for gateways in where.values())  # a session stays on its gateway
    assert all(sorted(s) == list(range(len(s))) for s in seqs.values())  # seq gap-free per session
    assert stats.sequences == 6 and stats.trainable_tokens > 0
    logs = sorted(p.name for p in cfg.run_dir.glob("gateway-*.log"))  # the run's gateways, one log each
    assert logs == ["gateway-0.log", "gateway-1.log"]
    # Started once for the run: the final rollout went through the same two processes, and each rollout's
    # records were complete shards when it ended (the switch compacts the journal into the folder it leaves).
    assert loop.rollouts.gateways is not None and loop.rollouts.gateways.started == 2
    final = read_all(cfg.run_dir / "iter-1" / "flows", include_journal=False).to_pylist()
    assert len({r["session_id"] for r in final}) == 6
    assert not list(flows.rglob("*.polarj"))
    assert json.loads((cfg.run_dir / "loop.json").read_text())[0]["requests"] == stats.requests
