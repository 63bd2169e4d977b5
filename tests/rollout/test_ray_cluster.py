"""Rollouts and the loop on a real local Ray cluster: a head without CPUs and two worker nodes (separate raylets,
`polar_rollout` resource), driven by the real `polar-mitm` CLI; engines are real embedded engines behind the real
sglang-router. A worker node is killed mid-rollout: nothing finished is lost, nothing is counted twice."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines import weights
from polar_mitm.processes import children
from polar_mitm.storage.judgments import read_judgments
from polar_mitm.storage.records import read_all
from tests.judges.test_judges import judge  # noqa: F401  (the scripted judge server, a fixture)

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"
SMALL = {"object_store_memory": 80 << 20}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, **SMALL}
    )
    workers = [cluster.add_node(num_cpus=1, resources={"polar_rollout": 1}, **SMALL) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster, workers
    cluster.shutdown()


@pytest.fixture(scope="module")
def engine_key_file(tmp_path_factory) -> Path:
    """The engines' API key, as a user of engines started elsewhere hands it to `polar-mitm`: a mode-600 file named
    by $POLAR_ENGINE_KEY_FILE (the driver passes it on to each node's gateway)."""
    path = tmp_path_factory.mktemp("engine-key") / "key"
    path.write_text(engine_keys.new_key())
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def scripted_engines(tmp_path_factory, engine_key_file):
    """Two embedded engines playing the CPU demo's scripted choice policy (as `polar-mitm loop` starts one)."""
    started = [
        engine_processes.start_engine(
            "tiny",
            log=tmp_path_factory.mktemp(f"engine{k}") / "engine.log",
            extra_args=["--threads", "1", "--script", str(EXAMPLES / "policy.json")],
            api_key=engine_key_file.read_text(),
        )
        for k in range(2)
    ]
    os.environ[engine_keys.KEY_FILE_ENV] = str(engine_key_file)  # the CLIs this module starts read it
    yield [url for _, url in started]
    os.environ.pop(engine_keys.KEY_FILE_ENV, None)
    for proc, _ in started:
        children.stop(proc)


def node_name(node) -> str:
    return f"{node.node_ip_address}-{node.node_id[:8]}"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "polar_mitm", *args]


def test_one_loop_iteration_on_two_nodes_behind_the_router(
    cluster,
    scripted_engines,
    judge,  # noqa: F811
    tmp_path,
):
    """A loop iteration on two nodes, one of its tasks judged (rubric, weight 0.2) on the driver from the
    nodes' records and harness logs."""
    ray_cluster, _ = cluster
    before = weights.worker_versions(scripted_engines)
    run = tmp_path / "run"
    tasks = shutil.copytree(EXAMPLES, tmp_path / "tasks") / "tasks.jsonl"
    lines = [json.loads(line) for line in tasks.read_text().splitlines() if line.strip()]
    lines[0]["judge"] = {"mode": "rubric", "rubric": "out.txt holds hello."}
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run(
        cli(
            "loop",
            str(tasks),
            "--iterations",
            "1",
            "-g",
            "4",
            "-c",
            "2",
            "--engine",
            ",".join(scripted_engines),
            "--ray",
            ray_cluster.address,
            "-o",
            str(run),
            "--learning-rate",
            "1e-2",
            "--judge-url",
            judge.url,
            "--judge-model",
            "scripted",
        ),
        capture_output=True,
        text=True,
        timeout=900,
        env={"HF_HUB_OFFLINE": "1", **_env()},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    it = run / "iter-0"
    node_dirs = sorted((it / "flows").glob("node-*"))
    assert len(node_dirs) == 2
    records = {d.name: read_all(d, include_journal=False).to_pylist() for d in node_dirs}
    assert all(rows for rows in records.values()), {k: len(v) for k, v in records.items()}  # both nodes wrote
    rewards = pq.read_table(it / "rewards.parquet").to_pylist()
    assert len(rewards) == 12 and len({(r["task_id"], r["sample_index"]) for r in rewards}) == 12
    assert len({r["session_id"] for r in rewards}) == 12
    recorded = {r["session_id"] for rows in records.values() for r in rows}
    assert {r["session_id"] for r in rewards} == recorded  # every session: records and exactly one reward
    judgments = read_judgments(it / "judgments")  # the judged task's four sessions, wherever they ran
    judged = [r for r in rewards if r["task_id"] == lines[0]["task_id"]]
    assert len(judged) == 4 and {r["session_id"] for r in judged} == set(judgments)
    for row in judged:
        judgment = judgments[row["session_id"]]
        assert judgment.status in ("judged", "cached") and judgment.score is not None, judgment
        assert row["reward"] == pytest.approx(judgment.outcome + 0.2 * judgment.score)
    report = json.loads((it / "ray_report.json").read_text())
    assert len(report["per_node"]) == 2 and not report["dead_nodes"]
    # The weights were pushed to both engines (the router does not forward the push): same new version.
    after = weights.worker_versions(scripted_engines)
    assert len(set(after.values())) == 1 and int(next(iter(after.values()))) > max(
        int(v) for v in before.values()
    )
    merged = pq.read_table(it / "merged").to_pylist()
    assert merged and all(sum(r["loss_mask"]) > 0 for r in merged)
    assert (it / "train" / "metrics.jsonl").exists()


CURL_THEN_SLEEP = (
    "cmd:curl -sf {base_url}/v1/chat/completions -H 'content-type: application/json' "
    '-d \'{{"model": "m", "max_tokens": 2, "messages": [{{"role": "user", "content": "hi"}}]}}\' '
    "> /dev/null && sleep 3"
)


def test_a_worker_node_killed_mid_rollout_loses_nothing_finished_and_counts_nothing_twice(
    cluster, scripted_engines, tmp_path
):
    ray_cluster, workers = cluster
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"task_id": f"t{k}", "prompt": "p", "eval": {"command": "true"}}) + "\n"
            for k in range(2)
        )
    )
    work, out = tmp_path / "work", tmp_path / "flows"
    driver = subprocess.Popen(
        cli(
            "rollout",
            str(tasks),
            "--harness",
            CURL_THEN_SLEEP,
            "-g",
            "6",
            "-c",
            "2",
            "--ready-buffer",
            "0",
            "--engine",
            scripted_engines[0],
            "--ray",
            ray_cluster.address,
            "--out",
            str(out),
            "--rewards",
            str(tmp_path / "r.parquet"),
            "--work-dir",
            str(work),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    victim = workers[1]
    logs = work / "logs" / node_name(victim)
    deadline = time.monotonic() + 300
    while len(list(logs.glob("*.log"))) < 3:  # its third session started: the first ones are finished
        assert driver.poll() is None and time.monotonic() < deadline, driver.stdout.read()
        time.sleep(0.2)
    time.sleep(0.5)
    ray_cluster.remove_node(victim, allow_graceful=False)
    output, _ = driver.communicate(timeout=300)
    assert driver.returncode == 0, output[-3000:]
    dead = node_name(victim)
    assert f"node {dead} died:" in output

    report = json.loads((work / "ray_report.json").read_text())
    assert report["dead_nodes"] == [dead]
    rewards = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert len(rewards) == 12 and len({(r["task_id"], r["sample_index"]) for r in rewards}) == 12
    by_session = {r["session_id"]: r for r in rewards}
    finished_on_dead = [o for o in report["outcomes"] if o["node"] == dead]
    assert finished_on_dead and all(o["status"] == "ok" for o in finished_on_dead)
    lost = report["lost_attempts"]
    assert lost and all(a["session_id"] not in by_session for a in lost)  # a lost attempt has no reward row
    for attempt in lost:  # ... and its sample was run again and counted once, under a new id
        again = [
            r for r in rewards if (r["task_id"], r["sample_index"]) == (attempt["task_id"], attempt["index"])
        ]
        assert len(again) == 1 and again[0]["status"] in ("ok", "node_lost")
    # The dead node's finished sessions kept their records (its journal compacted by the driver).
    dead_rows = read_all(out / f"node-{dead}", include_journal=False).to_pylist()
    assert {o["session_id"] for o in finished_on_dead} <= {r["session_id"] for r in dead_rows}
    assert all(r["status"] == "ok" for r in rewards)


def test_judged_tasks_on_the_cluster_read_each_nodes_records_and_harness_logs(
    cluster,
    scripted_engines,
    judge,  # noqa: F811
    tmp_path,
):
    """`rollout --ray` with a judged task: the judge reads each session's records (out/node-*) and its harness log
    (WORK_DIR/logs/NODE/): the log's `echo hello >` is what the scripted judge scores 4 of 5 (rubric, weight 0.2)."""
    ray_cluster, _ = cluster
    tasks = tmp_path / "tasks.jsonl"
    judged = {"mode": "rubric", "rubric": "out.txt holds hello."}
    tasks.write_text(json.dumps({"task_id": "j", "prompt": "p", "eval": "true", "judge": judged}) + "\n")
    harness = CURL_THEN_SLEEP.replace("sleep 3", "echo 'ran: echo hello > out.txt'")
    work, out, rewards = tmp_path / "work", tmp_path / "flows", tmp_path / "r.parquet"
    argv = [
        "rollout",
        str(tasks),
        "--harness",
        harness,
        "-g",
        "2",
        "-c",
        "1",
        "--engine",
        scripted_engines[0],
    ]
    argv += [
        "--ray",
        ray_cluster.address,
        "--out",
        str(out),
        "--rewards",
        str(rewards),
        "--work-dir",
        str(work),
    ]
    argv += ["--judge-url", judge.url, "--judge-model", "scripted"]
    done = subprocess.run(cli(*argv), capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = pq.read_table(rewards).to_pylist()
    judgments = read_judgments(work / "judgments")
    assert len(rows) == 2 and {r["session_id"] for r in rows} == set(judgments)
    for row in rows:
        assert judgments[row["session_id"]].outcome == 1.0
        assert row["reward"] == pytest.approx(1 + 0.2 * 4 / 5)  # the log was read on its node's folder


def test_a_node_that_died_just_before_the_rollout_is_left_out_and_reported(
    cluster, scripted_engines, tmp_path
):
    """Ray lists a node that just died as alive until its heartbeats are missed (~16 s): the driver places an actor
    there that dies unstarted. The rollout goes on the nodes left and reports the dead one (it failed the whole
    rollout before). The node is removed right before the driver starts, well inside that window."""
    ray_cluster, _ = cluster
    doomed = ray_cluster.add_node(num_cpus=1, resources={"polar_rollout": 1}, **SMALL)
    ray_cluster.wait_for_nodes()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task_id": "t", "prompt": "p", "eval": "true"}) + "\n")
    harness = CURL_THEN_SLEEP.replace("sleep 3", "true")
    work, out, rewards = tmp_path / "work", tmp_path / "flows", tmp_path / "r.parquet"
    ray_cluster.remove_node(doomed, allow_graceful=False)
    argv = [
        "rollout",
        str(tasks),
        "--harness",
        harness,
        "-g",
        "2",
        "-c",
        "1",
        "--engine",
        scripted_engines[0],
    ]
    argv += [
        "--ray",
        ray_cluster.address,
        "--out",
        str(out),
        "--rewards",
        str(rewards),
        "--work-dir",
        str(work),
    ]
    done = subprocess.run(cli(*argv), capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    dead = node_name(doomed)
    report = json.loads((work / "ray_report.json").read_text())
    assert dead in report["dead_nodes"], report["dead_nodes"]
    assert f"node {dead} died: 0 finished session(s) kept" in done.stdout + done.stderr
    assert dead not in report["per_node"] and sum(report["per_node"].values()) == 2  # the nodes left ran them
    assert [r["status"] for r in pq.read_table(rewards).to_pylist()] == ["ok", "ok"]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1"}
