"""`polar-mitm loop --resume` after SIGKILL (issue 26 item 1): a real loop process on the tiny model and the scripted
policy is killed — with everything it started — at a moment read from its own progress files (`iter-K/state.json`,
`iter-K/sessions.jsonl`), then carried on with `--resume -o RUN` alone.

What a resumed run must show, whatever stage the kill hit: every iteration once in loop.json; every session of the
run rewarded exactly once, the finished sessions of an interrupted rollout kept and the others re-run under new ids
(none of them merged with a killed session's records); each iteration trains on its own rewarded sessions (the
structure of an uninterrupted run: tasks × group size per iteration) and is trained once; the engine serves the last
trained weights (the next rollout's records carry that version).

One run pays for all of it: killed in iteration 0's rollout, merge, training and push, then in iteration 1's
rollout, resumed after each kill, with every tracker on (test_trackers' checks of one tracked run across resumes).
The closing table (printed with `-s`) gives, per kill, the counts at the kill and at the next kill (or the end).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.loop.run_state import read_lines
from polar_mitm.loop.trackers import TRACKER_STATE
from polar_mitm.storage.records import read_all
from polar_mitm.train.continuation import RunState

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"
TASKS, GROUP = 2, 2
LOOP_ARGS = ["-g", str(GROUP), "-c", "2", "--model", "tiny", "--max-tokens", "64", "--learning-rate", "1e-2"]
LOOP_ARGS += ["--script", str(EXAMPLES / "policy.json")]
# Every iteration trains, flat or not: a kill can land in any training.
LOOP_ARGS += ["--keep-zero-advantage-groups"]
DEADLINE_S = 300
ROWS: list[str] = []  # the closing table


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    """The first two CPU demo tasks (workspaces resolved)."""
    rows = [json.loads(line) for line in (EXAMPLES / "tasks.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        row["workspace"]["dir"] = str((EXAMPLES / row["workspace"]["dir"]).resolve())
    path = tmp_path_factory.mktemp("resume-tasks") / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:TASKS]))
    return path


def loop_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "polar_mitm", "loop", *args]


def start_loop(run_dir: Path, *args: str) -> subprocess.Popen:
    """`polar-mitm loop ARGS` in the background, its output in RUN-N.log beside the run directory."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = run_dir.parent / f"{run_dir.name}-{len(list(run_dir.parent.glob('*.log')))}.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            loop_argv(*args), stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it (harnesses run in their own sessions, so a process group is not enough)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def kill_everything(proc: subprocess.Popen) -> None:
    """SIGKILL the loop and all it started, as a lost machine or an OOM kill of the job would."""
    for pid in descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def state(run_dir: Path, k: int) -> dict:
    path = run_dir / f"iter-{k}" / "state.json"
    return json.loads(path.read_text()) if path.exists() else {"running": None, "stages": {}}


def kill_at(run_dir: Path, proc: subprocess.Popen, k: int, stage: str) -> dict:
    """Wait (polling the run's own files while the process runs) until iteration k is in `stage` — for a rollout,
    once a session has finished and others have not — then kill; returns what the files said at the kill."""
    for _ in range(DEADLINE_S * 20):
        now = state(run_dir, k)
        finished = len(read_lines(run_dir / f"iter-{k}" / "sessions.jsonl"))
        if now["running"] == stage and (stage != "rollout" or 0 < finished < TASKS * GROUP):
            kill_everything(proc)
            return {
                "state": state(run_dir, k),
                "counts": counts(run_dir),
                "trackers": trackers_at_kill(run_dir),
            }
        try:
            proc.wait(timeout=0.05)  # the poll interval; returns at once if the loop ended
        except subprocess.TimeoutExpired:
            continue
        tail = proc.log.read_text()[-4000:]  # type: ignore[attr-defined]
        raise AssertionError(
            f"the loop exited ({proc.returncode}) before iteration {k} reached {stage}:\n{tail}"
        )
    kill_everything(proc)
    raise AssertionError(f"iteration {k} never reached {stage}")


def trackers_at_kill(run_dir: Path) -> dict:
    """RUN/trackers.json as the kill left it (empty before the trackers opened)."""
    path = run_dir / TRACKER_STATE
    return json.loads(path.read_text()) if path.exists() else {}


def rewarded(run_dir: Path, k: int) -> list[dict]:
    path = run_dir / f"iter-{k}" / "rewards.parquet"
    return pq.read_table(path).to_pylist() if path.exists() else []


def counts(run_dir: Path) -> dict[str, int]:
    """Iterations done, sessions finished (journalled), sessions rewarded, trainings saved."""
    loop = json.loads((run_dir / "loop.json").read_text()) if (run_dir / "loop.json").exists() else []
    ks = range(len(list(run_dir.glob("iter-*"))))
    return {
        "iterations": len(loop),
        "sessions": sum(len(read_lines(run_dir / f"iter-{k}" / "sessions.jsonl")) for k in ks),
        "rewarded": sum(len(rewarded(run_dir, k)) for k in ks),
        "trained": RunState.load(run_dir / "trainer-state").trainings,
    }


def merged_sessions(run_dir: Path, k: int) -> Counter:
    """Session ids of iteration k's training shards, one count per sequence."""
    shards = sorted((run_dir / f"iter-{k}" / "merged").rglob("*.parquet"))
    return Counter(
        sid
        for shard in shards
        for sid in pq.read_table(shard, columns=["session_id"])["session_id"].to_pylist()
    )


def check_resumed_run(run_dir: Path, iterations: int, before: list[dict]) -> None:
    """What any resumed run must show (the module docstring's list), given what the files said at each kill."""
    loop = json.loads((run_dir / "loop.json").read_text())
    assert [row["iteration"] for row in loop] == list(range(iterations))
    everyone: Counter = Counter()
    for k in range(iterations):
        rows = rewarded(run_dir, k)
        assert len(rows) == TASKS * GROUP and all(r["reward"] is not None for r in rows)
        assert Counter(r["task_id"] for r in rows) == {t: GROUP for t in {r["task_id"] for r in rows}}
        assert len({r["task_id"] for r in rows}) == TASKS
        everyone.update(r["session_id"] for r in rows)
        journalled = [r["session_id"] for r in read_lines(run_dir / f"iter-{k}" / "sessions.jsonl")]
        assert sorted(journalled) == sorted(r["session_id"] for r in rows)  # each finished once, none lost
        trained = merged_sessions(run_dir, k)
        assert set(trained) == {r["session_id"] for r in rows}  # every rewarded session, nothing else
        rows = read_lines(run_dir / f"iter-{k}" / "train" / "metrics.jsonl")
        steps = [r["run_step"] for r in rows if "loss" in r]
        assert steps and len(steps) == len(set(steps))  # one training, no step twice
    assert all(n == 1 for n in everyone.values())  # no session rewarded twice across the run
    assert RunState.load(run_dir / "trainer-state").trainings == iterations
    # Each rollout sampled from the weights the iteration before it trained (the initial ones first): after a kill
    # the engine was brought back to the last trained weights.
    for k in range(iterations):
        kept = {r["session_id"] for r in rewarded(run_dir, k)}
        sampled = {
            row["weight_version"]
            for row in read_all(run_dir / f"iter-{k}" / "flows").to_pylist()
            if row["session_id"] in kept
        }
        assert sampled == {loop[k - 1]["weight_version"] if k else "0"}, (k, sampled)
    for kill in before:
        killed = kill["state"]
        assert killed["running"] is not None and killed["running"] not in killed["stages"]
    events = [e["event"] for e in read_lines(run_dir / "events.jsonl")]
    assert events[0] == "start" and events.count("resume") == len(before) and events[-1] == "finished"
    assert events.count("iteration_done") == iterations


def check_kept_sessions(
    run_dir: Path, k: int, journalled_at_kill: list[str], recorded_at_kill: set[str]
) -> None:
    """An interrupted rollout: its finished sessions kept; the re-run ones are new ids, never a killed one's."""
    final = {r["session_id"] for r in rewarded(run_dir, k)}
    assert set(journalled_at_kill) <= final
    rerun = final - set(journalled_at_kill)
    assert rerun and not rerun & recorded_at_kill


def table_row(stage: str, before: dict, after: dict) -> str:
    keys = ("iterations", "sessions", "rewarded", "trained")
    return f"| {stage:<14} | " + " | ".join(f"{before[key]} → {after[key]}" for key in keys) + " |"


def print_table() -> None:
    print("\n| killed at      | iterations | sessions | rewarded | trained |")
    print("|---|---|---|---|---|")
    for row in ROWS:
        print(row)


# The kills of the one run, in order: (iteration, stage). Each resume redoes the stage the kill hit and runs on to
# the next kill point; the last kill (iteration 1's rollout) follows the push kill, so its rollout shows the engine
# restarted and pushed iteration 0's weights at start.
KILLS = [(0, "rollout"), (0, "merge"), (0, "train"), (0, "push"), (1, "rollout")]


def interrupted_rollout(run_dir: Path, k: int) -> tuple[list[str], set[str]]:
    """Iteration k's finished sessions at a kill, and the sessions it had records of that had not finished."""
    journalled = [r["session_id"] for r in read_lines(run_dir / f"iter-{k}" / "sessions.jsonl")]
    recorded = {row["session_id"] for row in read_all(run_dir / f"iter-{k}" / "flows").to_pylist()}
    return journalled, recorded - set(journalled)


@pytest.mark.slow
def test_one_run_killed_at_every_stage_and_resumed_each_time(task_file, tmp_path):
    """One 2-iteration run killed with SIGKILL in iteration 0's rollout, merge, training and push, then in iteration
    1's rollout, resumed with `--resume -o RUN` alone after each kill; `--keep-checkpoints 1` kept what each resume
    needed and pruned iteration 0's weights once iteration 1 had trained; the three trackers hold one run."""
    from tests.loop.test_trackers import ALL, check_one_tracked_run_across_resumes, tracker_state

    run_dir = tmp_path / "run"
    argv = [str(task_file), "-o", str(run_dir), "-n", "2", "--keep-checkpoints", "1", "--report-to", ALL]
    proc = start_loop(run_dir, *argv, *LOOP_ARGS)
    first_log = proc.log  # type: ignore[attr-defined]
    kills, rollouts = [], {}
    for k, stage in KILLS:
        kills.append(kill_at(run_dir, proc, k, stage))
        if stage == "rollout":
            rollouts[k] = interrupted_rollout(run_dir, k)
        # (the log format may change on a resume: it is how the run is shown, not what it does)
        proc = start_loop(run_dir, "-o", str(run_dir), "--resume", "--log-format", "json")
    assert proc.wait(timeout=DEADLINE_S) == 0, proc.log.read_text()[-3000:]  # type: ignore[attr-defined]
    # Not a terminal: the first start said its stages as lines; the last one as JSON objects, ending on `finished`.
    assert re.search(r"^\[\d:\d\d:\d\d\] iteration 1/2 · rollout", first_log.read_text(), re.M)
    events = [json.loads(line) for line in proc.log.read_text().splitlines() if line.startswith("{")]  # type: ignore[attr-defined]
    assert {"stage", "iteration", "finished"} <= {e["event"] for e in events}
    assert [e["iteration"] for e in events if e["event"] == "iteration"][-1] == 1
    assert events[-1]["event"] == "finished" and events[-1]["iterations"] == 2
    # Iteration 0's reward was logged before the last kill, and is in each store once after it.
    assert kills[-1]["trackers"]["last_steps"]["loop/reward_mean"] == 0
    assert tracker_state(run_dir)["last_steps"]["loop/reward_mean"] == 1
    check_resumed_run(run_dir, 2, kills)
    for k, (journalled, unfinished) in rollouts.items():
        check_kept_sessions(run_dir, k, journalled, unfinished)
    assert not list((run_dir / "iter-0" / "train").glob("*.safetensors"))
    assert not (run_dir / "iter-0" / "train" / "engine-weights").exists()
    assert list((run_dir / "iter-1" / "train" / "engine-weights").glob("*.safetensors"))
    assert (run_dir / "iter-0" / "train" / "metrics.jsonl").exists()
    afterwards = [kill["counts"] for kill in kills[1:]] + [counts(run_dir)]
    for (k, stage), kill, after in zip(KILLS, kills, afterwards, strict=True):
        ROWS.append(table_row(f"{stage} (iter {k})", kill["counts"], after))
    print_table()
    check_one_tracked_run_across_resumes(run_dir, starts=len(KILLS) + 1, first=kills[0]["trackers"])


def test_resume_refuses_other_options_and_a_missing_record_in_one_line(task_file, tmp_path):
    from polar_mitm.loop.config import LoopConfig
    from polar_mitm.loop.run_state import record_run

    run_dir = tmp_path / "run"
    missing = subprocess.run(loop_argv("-o", str(run_dir), "--resume"), capture_output=True, text=True)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "run.json does not exist" in missing.stderr
    run_dir.mkdir()
    record_run(run_dir, LoopConfig(tasks=task_file, run_dir=run_dir, group_size=GROUP, learning_rate=1e-2))
    other = subprocess.run(
        loop_argv("-o", str(run_dir), "--resume", "-g", "3", "--learning-rate", "1e-2", "--beta", "0.5"),
        capture_output=True,
        text=True,
    )
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert "group_size 2→3" in other.stderr and "beta" in other.stderr and "learning_rate" not in other.stderr
    no_tasks = subprocess.run(loop_argv("-o", str(tmp_path / "new")), capture_output=True, text=True)
    assert no_tasks.returncode == 2 and "missing TASKS" in no_tasks.stderr


def test_a_save_killed_midway_leaves_the_previous_trainer_state(tmp_path):
    """continuation.py's swap: a staging copy without run_state.json (killed mid-save) is dropped; a complete one
    replaces the state, also when the kill came between the two renames."""
    from polar_mitm.storage.run_layout import RUN_STATE_FILE
    from polar_mitm.train.continuation import publish_run_state, recover_run_state, staging_dir

    def save(directory: Path, trainings: int, complete: bool = True) -> None:
        staged = staging_dir(directory)
        staged.mkdir(parents=True, exist_ok=True)
        (staged / "optimizer.pt").write_text(f"moments {trainings}")
        if complete:
            RunState(trainings=trainings).save(staged)

    directory = tmp_path / "trainer-state"
    save(directory, 1)
    publish_run_state(directory)
    save(directory, 2, complete=False)  # killed before run_state.json
    recover_run_state(directory)
    assert RunState.load(directory).trainings == 1 and (directory / "optimizer.pt").read_text() == "moments 1"
    assert not staging_dir(directory).exists()
    save(directory, 2)
    directory.rename(directory.with_name("trainer-state.old"))  # killed between the two renames
    recover_run_state(directory)
    assert RunState.load(directory).trainings == 2 and (directory / "optimizer.pt").read_text() == "moments 2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer-state"]
    assert (directory / RUN_STATE_FILE).exists()


def test_a_line_appended_after_a_torn_one_is_its_own_line(tmp_path):
    """A kill mid-append leaves a torn last line (sessions.jsonl, events.jsonl); what the resumed run appends next
    must not be glued to it and lost with it."""
    from polar_mitm.loop.run_state import append_line

    path = tmp_path / "sessions.jsonl"
    path.write_text('{"session_id": "a"}\n{"session_id": "tor')
    append_line(path, {"session_id": "b"})
    append_line(path, {"session_id": "c"})
    assert [row["session_id"] for row in read_lines(path)] == ["a", "b", "c"]


def test_keep_checkpoints_never_prunes_the_weights_a_skipped_training_left_in_service(tmp_path):
    """An iteration with only flat groups trains nothing (no weights in its train/): `--keep-checkpoints 1` keeps the
    newest training that holds weights, which is what the engine serves and a resume starts from."""
    from polar_mitm.loop.run_state import prune_checkpoints

    for k in (0, 1):
        (tmp_path / f"iter-{k}" / "train" / "checkpoint-2").mkdir(parents=True)
        (tmp_path / f"iter-{k}" / "train" / "model.safetensors").write_bytes(b"w")
    (tmp_path / "iter-2" / "train").mkdir(parents=True)
    (tmp_path / "iter-2" / "train" / "skipped.json").write_text("{}")
    removed = prune_checkpoints(tmp_path, 1, last_trained=2)
    assert {p.relative_to(tmp_path).as_posix() for p in removed} == {
        "iter-0/train/checkpoint-2",
        "iter-0/train/model.safetensors",
    }
    assert (tmp_path / "iter-1" / "train" / "model.safetensors").exists()
    assert (tmp_path / "iter-2" / "train" / "skipped.json").exists()


@pytest.mark.slow
def test_a_loop_killed_in_a_push_under_running_sessions_resumes(task_file, tmp_path):
    """--overlap 1: iteration 1's sessions run while iteration 0's weights are pushed. SIGKILL in that push (the
    loop, its engine mid-swap, the sessions mid-call), then `--resume`: the push is done again on the restarted
    engine, iteration 1's finished sessions are kept and the rest run again, each iteration is trained once, and
    every call of iteration 1 was sampled by the initial weights or by iteration 0's, never anything else."""
    run_dir = tmp_path / "run"
    argv = [str(task_file), "-o", str(run_dir), "-n", "2", "--overlap", "1"]
    proc = start_loop(run_dir, *argv, *LOOP_ARGS)
    kill = kill_at(run_dir, proc, 0, "push")
    assert "rollout" in state(run_dir, 1)["stages"] or state(run_dir, 1)["running"] == "rollout"
    journalled = [r["session_id"] for r in read_lines(run_dir / "iter-1" / "sessions.jsonl")]
    proc = start_loop(run_dir, "-o", str(run_dir), "--resume")
    assert proc.wait(timeout=DEADLINE_S) == 0, proc.log.read_text()[-3000:]  # type: ignore[attr-defined]
    loop = json.loads((run_dir / "loop.json").read_text())
    assert [row["iteration"] for row in loop] == [0, 1]
    assert kill["state"]["running"] == "push" and "push" in state(run_dir, 0)["stages"]
    # The restarted engine was given iteration 0's weights as the resumed loop started, so its push stage found
    # them served (nothing to report); iteration 1's push ran under no kill.
    assert loop[0]["push"] is None and loop[1]["push"]["mode"] == "swap"
    assert RunState.load(run_dir / "trainer-state").trainings == 2
    for k in (0, 1):
        rows = rewarded(run_dir, k)
        assert len(rows) == TASKS * GROUP and len({r["session_id"] for r in rows}) == TASKS * GROUP
        assert set(merged_sessions(run_dir, k)) == {r["session_id"] for r in rows}
    kept = {r["session_id"] for r in rewarded(run_dir, 1)}
    assert set(journalled) <= kept  # finished before the kill: kept, not run again
    sampled = {
        row["weight_version"]
        for row in read_all(run_dir / "iter-1" / "flows").to_pylist()
        if row["session_id"] in kept
    }
    assert sampled <= {"0", loop[0]["weight_version"]}, sampled
    assert sum(loop[1]["token_staleness"].values()) == loop[1]["trainable_tokens"]
