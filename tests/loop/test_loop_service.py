"""`polar-mitm loop --service URL` (issue 40 §2): the loop as the rollout service's first client.

A real `serve-rollouts` process (embedded engine playing the demo's scripted policy, its gateway, uvicorn) serves
every rollout; the loop trains on the traces it answers and pushes its weights through `POST /rollout/weights`.
Checked: through the service, the demo's rewards and merged sequences (ids, masks, turns; logprobs to 1e-4) equal the in-process runner's (greedy, so both
sample the same); a two-iteration run trains, pushes, and its second rollout is sampled by the pushed version; a
service that samples at another temperature, and options only the service can honour, are one line and exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.loop import Loop
from polar_mitm.processes import ports
from polar_mitm.storage.merged import read_merged
from tests.service.test_service import TOKEN, start_service, stop

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "cpu_tasks"
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def greedy_service(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop-service")
    port = ports.free_port()
    proc = start_service(
        root / "out", port, "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--max-sessions", "4"
    )
    yield f"http://127.0.0.1:{port}", root / "out"
    stop(proc)


def rollout_only(run_dir: Path, **changes) -> Path:
    """One rollout + merge of the demo tasks (no training: the final rollout of a zero-iteration run)."""
    cfg = LoopConfig(
        tasks=EXAMPLES / "tasks.jsonl",
        run_dir=run_dir,
        iterations=0,
        group_size=2,
        concurrency=4,
        model="tiny",
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        final_rollout=True,
        **changes,
    )
    Loop(cfg).run()
    return run_dir / "iter-0"


def per_task(it: Path) -> tuple[dict, dict]:
    """Each task's rewards and merged sequences (ids, mask, logprobs, turns, reward), order-free within the group."""
    task_of = {r["session_id"]: r["task_id"] for r in pq.read_table(it / "rewards.parquet").to_pylist()}
    rewards: dict[str, list] = defaultdict(list)
    for row in pq.read_table(it / "rewards.parquet").to_pylist():
        rewards[row["task_id"]].append((row["reward"], row["status"]))
    merged: dict[str, list] = defaultdict(list)
    for row in read_merged(it / "merged").to_pylist():
        assert row["task_id"] == task_of[row["session_id"]]
        logprobs = tuple(row["logprobs"])
        merged[row["task_id"]].append(
            (tuple(row["input_ids"]), tuple(row["loss_mask"]), logprobs, row["n_turns"], row["reward"])
        )
    return (
        {k: sorted(v) for k, v in rewards.items()},
        {k: sorted(v) for k, v in merged.items()},
    )


def test_through_the_service_rewards_and_merged_tokens_equal_the_in_process_runners(
    greedy_service, tmp_path, monkeypatch
):
    url, _ = greedy_service
    monkeypatch.setenv("POLAR_SERVICE_TOKEN", TOKEN)
    local = rollout_only(tmp_path / "local", script=EXAMPLES / "policy.json")
    served = rollout_only(tmp_path / "served", service_url=url)
    assert not (served / "flows").exists() and (served / "service_results.jsonl").exists()
    local_rewards, local_merged = per_task(local)
    served_rewards, served_merged = per_task(served)
    assert served_rewards == local_rewards and len(served_rewards) == 3

    # Whole sequences: ids and loss masks equal, logprobs within 1e-4 (the engine's prefix cache may prefill a turn
    # in another split, which moves a float32 logprob by an ulp or so: equal ids, not equal bits).
    assert {t: [(ids, mask, turns, r) for ids, mask, _, turns, r in v] for t, v in served_merged.items()} == {
        t: [(ids, mask, turns, r) for ids, mask, _, turns, r in v] for t, v in local_merged.items()
    }
    for task, seqs in served_merged.items():
        for (*_, served_lps, _, _), (*_, local_lps, _, _) in zip(seqs, local_merged[task], strict=True):
            assert max((abs(a - b) for a, b in zip(served_lps, local_lps, strict=True)), default=0.0) < 1e-4
    assert sum(len(v) for v in served_merged.values()) == 6
    assert any(any(mask) for seqs in served_merged.values() for _, mask, *_ in seqs)


def test_without_the_token_the_loop_says_so_in_one_line(greedy_service, tmp_path):
    url, _ = greedy_service
    env = {k: v for k, v in os.environ.items() if k != "POLAR_SERVICE_TOKEN"}
    done = loop_cli(tmp_path / "run", "--service", url, "--temperature", "0", env=env)
    assert done.returncode == 2 and "POLAR_SERVICE_TOKEN" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_service_sampling_at_another_temperature_is_refused_before_anything_runs(greedy_service, tmp_path):
    url, _ = greedy_service
    done = loop_cli(tmp_path / "run", "--service", url, "--temperature", "1.0")
    assert done.returncode == 2, done.stderr
    assert "--temperature 0.0" in done.stderr or "--temperature" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not list((tmp_path / "run").glob("iter-*"))


@pytest.mark.parametrize(
    "extra, said", [(["--engine", "http://127.0.0.1:9"], "--engine"), (["--eval-greedy"], "--eval-greedy")]
)
def test_options_only_the_service_can_honour_are_one_line(greedy_service, tmp_path, extra, said):
    url, _ = greedy_service
    done = loop_cli(tmp_path / "run", "--service", url, "--temperature", "0", *extra)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def loop_cli(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "polar_mitm", "loop", str(EXAMPLES / "tasks.jsonl"), "-o", str(run_dir)]
    argv += ["--model", "tiny", "--max-tokens", str(MAX_TOKENS), *args]
    base = env if env is not None else {**os.environ, "POLAR_SERVICE_TOKEN": TOKEN}
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=base)


def test_a_two_iteration_run_trains_through_the_service_and_pushes_its_weights(tmp_path):
    """Sampling at temperature 1 (groups with reward variance, so the first training steps): the second rollout is
    sampled by the weights the first training pushed, the service's engine serves the last ones after the run."""
    port = ports.free_port()
    proc = start_service(tmp_path / "svc", port, "--temperature", "1.0", "--max-tokens", str(MAX_TOKENS))
    try:
        url = f"http://127.0.0.1:{port}"
        run = tmp_path / "run"
        done = loop_cli(
            run, "--service", url, "-n", "2", "-g", "4", "--temperature", "1.0", "--learning-rate", "1e-2"
        )
        assert done.returncode == 0, done.stderr[-3000:]
        rows = json.loads((run / "loop.json").read_text())
        assert len(rows) == 2
        trained = [r["weight_version"] for r in rows]
        second = [
            json.loads(line) for line in (run / "iter-1" / "service_results.jsonl").read_text().splitlines()
        ]
        versions = {
            trace["metadata"]["weight_version_min"]
            for result in second
            for trace in result["trajectory"]["traces"]
        }
        assert versions == {trained[0]}, (versions, trained)
        from polar_mitm.service.client import Client

        with Client(url, TOKEN) as client:
            assert client.health()["weight_version"] == trained[-1]
        assert rows[0]["sequences"] > 0 and rows[0]["trainable_tokens"] > 0
        # iteration 1 trained on calls sampled by the weights its training started from
        assert set(rows[1]["call_staleness"]) == {"0"}, rows[1]["call_staleness"]
    finally:
        stop(proc)
