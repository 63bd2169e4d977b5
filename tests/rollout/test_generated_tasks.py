"""`polar-mitm tasks generate` (rollout/generated_tasks.py) and the answer check (rollout/answer_check.py): a split
whose held-out tasks no training prompt contains, the same files for the same seed, and a check that grades what
the harness finally said — run by the real rollout runner, which names the harness's output for the evaluation."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from polar_mitm.rollout.answer_check import grade
from polar_mitm.rollout.generated_tasks import FAMILIES, TaskSplit, check_split, generate, write_split
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig
from polar_mitm.rollout.tasks import load_tasks, passed


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("7", 1.0),
        ("  **7**.\n", 1.0),
        ('"7"', 1.0),
        ("3 + 4 equals 7.", 0.5),
        ("The answer is: 7", 0.5),
        ("3 + 4 will be 7.\n\nHowever, in Python you can also", 0.5),  # the first line counts
        ("Here is how:\n7", 0.0),
        ("7 or 8", 0.0),  # the last number counts
        ("1 2 3 4 5 6 7 8 9 7", 0.0),  # long: listing candidates earns nothing
        ("The sum of three and four, which you asked me about, is 7", 0.0),  # over SHORT_WORDS
        ("", 0.0),
        ("17", 0.0),
    ],
)
def test_the_answer_check_grades_the_reply(reply, reward):
    assert grade(reply, "7") == reward
    assert passed(reward) == (reward == 1.0)  # partial credit is reward, not a pass


def test_held_out_tasks_share_nothing_with_the_training_prompts(tmp_path):
    split = generate(list(FAMILIES), 20, 10, seed=3, root=tmp_path)
    assert len(split.train) == len(split.held_out) * 2 == 40
    train_prompts = " ".join(t["prompt"] for t in split.train)
    pairs = {tuple(t["task_id"].split("-")[1:]) for t in split.train if t["family"] == "add"}
    for task in split.held_out:
        assert task["prompt"] not in train_prompts
        if task["family"] == "add":
            assert tuple(task["task_id"].split("-")[1:]) not in pairs
        else:  # neither its file name nor its word is in any training prompt
            name, word = task["prompt"].split()[3], task["prompt"].split()[-1]
            assert name not in train_prompts and word not in train_prompts
    leaked = TaskSplit(split.train, [*split.held_out, split.train[0]])
    with pytest.raises(ValueError, match="also a training task"):
        check_split(leaked)


def test_the_same_seed_writes_the_same_files_and_the_cli_refuses_bad_input_in_one_line(tmp_path):
    cli = [sys.executable, "-m", "polar_mitm.cli", "tasks", "generate", "--family", "add,write"]
    for name in ("a", "b"):
        done = subprocess.run(
            [*cli, "-o", str(tmp_path / name), "--seed", "5"], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
    for name in ("train.jsonl", "held_out.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text().replace(
            "/b/", "/a/"
        )
    tasks = load_tasks(tmp_path / "a" / "train.jsonl")
    assert len(tasks) == 32 and tasks[0].workspace_dir == tmp_path / "a" / "workspace"
    other = generate(["add"], 16, 8, seed=6, root=tmp_path)
    assert [t["task_id"] for t in other.held_out] != [
        json.loads(line)["task_id"] for line in (tmp_path / "a" / "held_out.jsonl").read_text().splitlines()
    ][:8]
    for bad, message in (
        (["--family", "sums"], "families must be among"),
        (["--train", "99"], "99 tasks asked"),
    ):
        done = subprocess.run([*cli, "-o", str(tmp_path / "c"), *bad], capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


ANSWERER = """import re, sys
a, b = map(int, re.match(r"What is (\\d+) \\+ (\\d+)", sys.argv[1]).groups())
print([f"{a + b}", f"{a} + {b} equals {a + b}.", f"{a + b + 1}", ""][int(sys.argv[2])])
"""


def test_a_rollout_grades_each_session_on_what_its_harness_answered(tmp_path):
    """The real runner and a `cmd:` harness that answers by session index: the number alone, a wordy right
    answer, a wrong number, nothing — graded 1.0, 0.5, 0.0, 0.0 on each task from the harness's own output."""
    split = generate(["add"], 2, 1, seed=0, root=tmp_path / "tasks")
    train, _ = write_split(split, tmp_path / "tasks")
    answerer = tmp_path / "answer.py"
    answerer.write_text(ANSWERER)
    rollout = Rollout(
        load_tasks(train),
        HarnessSpec(f"cmd:{sys.executable} {answerer} {{prompt}} {{index}}"),
        GatewayEndpoints("http://127.0.0.1:9"),  # the harness calls no model
        RolloutConfig(group_size=4, concurrency=4, workspace_root=tmp_path / "ws", log_dir=tmp_path / "logs"),
    )
    summary = asyncio.run(rollout.run())
    rewards = sorted((s.task.task_id, s.index, s.reward) for s in summary.sessions)
    expected = [(t["task_id"], i, r) for t in split.train for i, r in enumerate((1.0, 0.5, 0.0, 0.0))]
    assert rewards == sorted(expected)
