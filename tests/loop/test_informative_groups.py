"""Informative groups (dynamic sampling at rollout, `polar-mitm loop --min-informative-groups`, issue 26 item 4).

The selection is pure and checked on its own: which groups are flat (the trainer's zero-advantage test), the task
cycle each iteration enters, the size of each replacement wave and the waves a sampler draws. One real loop
iteration (tiny model, scripted policy) runs a task set built so that the iteration's first draw holds a task whose
checker always passes and two whose checker alternates pass/fail (so their groups always carry an advantage): the
flat group is counted and replaced by the one task left, the replacement's records land in the same flows, and the
trainer leaves exactly the flat group's sequences out of its batches.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer

from polar_mitm.loop.cli import checked_loop, groups_cell
from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.figures import IterationStats
from polar_mitm.loop.informative import (
    GroupSampler,
    SampledRolloutSummary,
    combined_summary,
    dynamic_sampling_problem,
    group_figures,
    group_rewards,
    is_informative,
    iteration_order,
    next_wave_size,
    sample_groups,
    uninformative_tasks,
)
from polar_mitm.loop.loop import Loop
from polar_mitm.rollout.runner import RolloutSummary, SessionRun
from polar_mitm.storage.merged import read_merged
from polar_mitm.storage.records import read_all
from polar_mitm.tasks.task_file import Task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cpu_tasks"


def sessions_of(rewards: dict[str, list[float | None]]) -> list[SessionRun]:
    """SessionRuns of tasks with the given rewards (None: a session cut by --keep)."""
    return [
        SessionRun(task=Task(task_id, "p"), index=i, session_id=f"{task_id}-{i}", reward=reward)
        for task_id, values in rewards.items()
        for i, reward in enumerate(values)
    ]


def test_a_group_is_informative_only_when_two_rewards_differ():
    assert not is_informative([])
    assert not is_informative([1.0])  # one session: zero advantage
    assert not is_informative([1.0, 1.0, 1.0]) and not is_informative([0.0, 0.0])
    assert not is_informative([0.1, 0.1, 0.1 + 1e-12])  # float noise, as train/advantages.py rounds it to 0
    assert is_informative([0.0, 1.0]) and is_informative([0.5, 0.5, 0.25])


def test_flat_groups_are_found_per_task_and_cut_sessions_do_not_count():
    sessions = sessions_of(
        {"all-pass": [1.0, 1.0], "mixed": [0.0, 1.0], "one-left": [1.0, None], "cut-mixed": [0.0, None, 1.0]}
    )
    assert list(group_rewards(sessions)) == ["all-pass", "mixed", "one-left", "cut-mixed"]
    assert group_rewards(sessions)["cut-mixed"] == [0.0, 1.0]
    assert uninformative_tasks(sessions) == ["all-pass", "one-left"]
    figures = group_figures(RolloutSummary(sessions, 1.0, 1.0))
    assert figures == {"groups": 4, "uninformative_groups": 2, "replaced_groups": 0}


def test_iteration_order_holds_every_task_once_and_its_initial_groups_go_round_the_cycle():
    tasks, per_iteration = 7, 3
    orders = [iteration_order(tasks, per_iteration, k, seed=0) for k in range(7)]
    for order in orders:
        assert sorted(order) == list(range(tasks))  # no task twice in an iteration
    # consecutive iterations' initial groups continue the same cycle: any ⌈7/3⌉ iterations in a row cover all tasks
    for k in range(len(orders) - 2):
        assert set().union(*(set(order[:per_iteration]) for order in orders[k : k + 3])) == set(range(tasks))
    # 7 iterations × 3 initial groups = 3 rounds of the cycle
    initial = [i for order in orders for i in order[:per_iteration]]
    assert sorted(initial[:tasks]) == list(range(tasks)) and initial == initial[:tasks] * per_iteration
    # the replacement candidates are not simply the next iteration's initial groups
    assert any(
        order[per_iteration : 2 * per_iteration] != after[:per_iteration]
        for order, after in zip(orders[:-1], orders[1:], strict=True)
    )
    assert iteration_order(tasks, per_iteration, 4, seed=0) == orders[4]  # a pure function of its arguments
    assert {tuple(iteration_order(tasks, per_iteration, 0, seed)) for seed in range(5)} != {tuple(orders[0])}
    assert iteration_order(0, 2, 3, seed=0) == []


def test_next_wave_size_stops_at_the_wanted_groups_the_budget_or_the_tasks_left():
    assert next_wave_size(informative=1, wanted=4, budget_left=5, candidates_left=9) == 3
    assert next_wave_size(informative=1, wanted=4, budget_left=2, candidates_left=9) == 2
    assert next_wave_size(informative=1, wanted=4, budget_left=5, candidates_left=1) == 1
    assert next_wave_size(informative=4, wanted=4, budget_left=5, candidates_left=9) == 0
    assert next_wave_size(informative=5, wanted=4, budget_left=5, candidates_left=9) == 0


def run_sampler(
    sampler: GroupSampler, outcome: dict[str, list[float]]
) -> tuple[list[list[str]], SampledRolloutSummary]:
    """Drive `sample_groups` with waves whose groups earn `outcome`'s rewards; (tasks of each wave, summary)."""
    waves: list[list[str]] = []

    async def run_wave(tasks: list[Task]) -> RolloutSummary:
        waves.append([t.task_id for t in tasks])
        return RolloutSummary(sessions_of({t.task_id: outcome[t.task_id] for t in tasks}), 2.0, 0.5)

    return waves, asyncio.run(sample_groups(sampler, run_wave))


def test_sampler_replaces_flat_groups_with_tasks_not_yet_run_until_enough_are_informative():
    outcome = {
        "a": [1.0, 1.0],
        "b": [0.0, 1.0],
        "c": [0.0, 0.0],
        "d": [1.0, 1.0],
        "e": [0.0, 1.0],
        "f": [0, 1],
    }
    order = [Task(t, "p") for t in "abcdef"]
    waves, summary = run_sampler(GroupSampler(order=order, wanted=3, budget=10), outcome)
    # a, c flat → two more (d, e); d flat → one more (f): three informative groups (b, e, f)
    assert waves == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert summary.replaced_groups == 3 and summary.waves == 3 and len(summary.sessions) == 12
    assert group_figures(summary) == {"groups": 6, "uninformative_groups": 3, "replaced_groups": 3}
    assert len({s.session_id for s in summary.sessions}) == 12


def test_sampler_stops_when_the_budget_is_spent_or_no_task_is_left():
    outcome = {t: [1.0, 1.0] for t in "abcdef"}  # every group flat
    order = [Task(t, "p") for t in "abcdef"]
    waves, summary = run_sampler(GroupSampler(order=order, wanted=2, budget=3), outcome)
    assert waves == [["a", "b"], ["c", "d"], ["e"]] and summary.replaced_groups == 3
    waves, summary = run_sampler(GroupSampler(order=order[:3], wanted=2, budget=10), outcome)
    assert waves == [["a", "b"], ["c"]] and summary.replaced_groups == 1
    waves, _ = run_sampler(GroupSampler(order=order, wanted=2, budget=0), outcome)
    assert waves == [["a", "b"]]


def test_combined_summary_weighs_utilisation_by_wall_time():
    first = RolloutSummary(sessions_of({"a": [1.0]}), wall_seconds=3.0, run_utilisation=1.0)
    second = RolloutSummary(sessions_of({"b": [0.0]}), wall_seconds=1.0, run_utilisation=0.2)
    combined = combined_summary([first, second], replaced_groups=1)
    assert combined.wall_seconds == 4.0 and combined.run_utilisation == pytest.approx(0.8)
    assert [s.task.task_id for s in combined.sessions] == ["a", "b"] and combined.wave_seconds == [3.0, 1.0]


def test_group_counts_reach_the_tracker_and_the_table():
    stats = IterationStats(
        0, "1", 6, 0.5, 0.5, 0.5, 6, 6, 10, 100, groups=3, uninformative_groups=1, replaced_groups=1
    )
    metrics = stats.tracked_metrics()
    assert (
        metrics["loop/groups"],
        metrics["loop/uninformative_groups"],
        metrics["loop/replaced_groups"],
    ) == (3, 1, 1)
    assert groups_cell(stats) == "2/3 +1"
    assert groups_cell(
        IterationStats(0, "1", 4, 1.0, 0.0, 1.0, 4, 4, 10, 100, groups=2, uninformative_groups=2)
    ) == ("0/2")


def test_options_that_cannot_work_together_are_refused():
    def problem(**fields) -> str | None:
        return dynamic_sampling_problem(LoopConfig(tasks=Path("t.jsonl"), run_dir=Path("run"), **fields))

    assert problem() is None and problem(min_informative_groups=2, resample_budget=0) is None
    assert "needs --min-informative-groups" in problem(resample_budget=2)
    assert "at least" in problem(min_informative_groups=0)
    assert "--ray" in problem(min_informative_groups=2, ray_address="local")
    assert "--group-size" in problem(min_informative_groups=2, group_size=1)
    assert "--keep-zero-advantage-groups" in problem(
        min_informative_groups=2, grpo={"keep_zero_advantage_groups": True}
    )


def test_loop_command_refuses_the_option_with_ray_in_one_line(tmp_path, capsys):
    cfg = LoopConfig(
        tasks=EXAMPLES / "tasks.jsonl", run_dir=tmp_path, min_informative_groups=2, ray_address="local"
    )
    with pytest.raises(typer.Exit) as stopped:
        checked_loop(cfg)  # `polar-mitm loop`'s check, before any engine starts
    assert stopped.value.exit_code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "not supported with --ray" in lines[0]


# -- one real loop iteration --------------------------------------------------------------------------------------

ALWAYS_PASSES = "always-passes"
WANTED = 2
GROUP_SIZE = 2


def alternating_check(counter: Path) -> str:
    """A checker that passes its task's 1st, 3rd, … evaluation and fails the others (serialised by a lock), so a
    group of two always holds one pass and one failure."""
    file, lock = shlex.quote(str(counter)), shlex.quote(f"{counter}.lock")
    return f"exec 9>>{lock}; flock 9; n=$(wc -l < {file}); echo x >> {file}; test $((n % 2)) -eq 0"


def task_file(out: Path) -> tuple[Path, list[str]]:
    """Three tasks: the one iteration 0 draws first always passes, the other two alternate; (file, ids in order)."""
    workspace = str((EXAMPLES / "workspaces" / "hello").resolve())
    order = iteration_order(3, WANTED, 0, seed=0)
    ids = ["alternates-a", "alternates-b", "alternates-c"]
    ids[order[0]] = ALWAYS_PASSES
    rows = []
    for task_id in ids:
        counter = out / f"{task_id}.count"
        counter.write_text("")
        check = "true" if task_id == ALWAYS_PASSES else alternating_check(counter)
        rows.append(
            {
                "task_id": task_id,
                "prompt": "Say that you are finished.",  # no scripted reply matches: the policy answers "Done."
                "workspace": {"dir": workspace},
                "eval": {"command": check},
                "timeouts": {"init": 30, "run": 120, "eval": 30},
            }
        )
    path = out / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, [ids[i] for i in order]


@pytest.mark.slow
def test_loop_replaces_a_flat_group_and_trains_only_informative_groups(tmp_path):
    tasks, order = task_file(tmp_path)
    run = tmp_path / "run"
    cfg = LoopConfig(
        tasks=tasks,
        run_dir=run,
        iterations=1,
        group_size=GROUP_SIZE,
        concurrency=2,
        model="tiny",
        script=EXAMPLES / "policy.json",
        max_tokens=64,
        min_informative_groups=WANTED,
        sandbox="none",  # the alternating check keeps a counter beside the workspaces, across sessions
    )
    [stats] = Loop(cfg).run()
    rewards = pq.read_table(run / "iter-0" / "rewards.parquet").to_pylist()
    by_task: dict[str, list[float]] = {}
    for row in rewards:
        by_task.setdefault(row["task_id"], []).append(row["reward"])
    # The first draw (order[:2]) holds the always-passing task: its flat group is replaced by the task left.
    assert set(by_task) == set(order) and all(len(v) == GROUP_SIZE for v in by_task.values())
    assert by_task[ALWAYS_PASSES] == [1.0, 1.0]
    assert all(sorted(v) == [0.0, 1.0] for task, v in by_task.items() if task != ALWAYS_PASSES)
    assert (stats.groups, stats.uninformative_groups, stats.replaced_groups) == (3, 1, 1)
    assert json.loads((run / "loop.json").read_text())[0]["replaced_groups"] == 1
    # The replacement wave went through the same gateway: every session's records are in the iteration's flows.
    recorded = {row["session_id"] for row in read_all(run / "iter-0" / "flows").to_pylist()}
    assert recorded == {row["session_id"] for row in rewards}
    # Training: the trainer's batch plan left out exactly the flat group's sequences, and kept every other one.
    flat_sessions = {row["session_id"] for row in rewards if row["task_id"] == ALWAYS_PASSES}
    sequences = (
        read_merged(run / "iter-0" / "merged", columns=["session_id"]).column("session_id").to_pylist()
    )
    flat_sequences = sum(session in flat_sessions for session in sequences)
    data = json.loads((run / "iter-0" / "data_stats.json").read_text())
    assert flat_sequences > 0 and data["zero_advantage_groups"] == 1 and not data["zero_advantage_kept"]
    assert data["zero_advantage_sequences"] == flat_sequences
    assert data["sequences_used"] - data["zero_advantage_sequences"] == len(sequences) - flat_sequences > 0
