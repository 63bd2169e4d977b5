"""`polar-mitm tasks generate` (tasks/generated.py) and the answer check (tasks/answer_check.py): a split
whose held-out tasks no training prompt contains, the same files for the same seed, and a check that grades what
the harness finally said — run by the real rollout runner, which names the harness's output for the evaluation."""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig
from polar_mitm.tasks.answer_check import grade
from polar_mitm.tasks.generated import FAMILIES, TaskSplit, add_task, check_split, generate, write_split
from polar_mitm.tasks.task_file import load_tasks, passed


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("7", 1.0),
        ("  **7**.\n", 1.0),
        ('"7"', 1.0),
        ("3 + 4 equals 7.", 0.5),
        ("The answer is: 7", 0.5),
        ("3 + 4 will be 7.\n\nHowever, in Python you can also", 0.5),  # the first line counts
        ("3 + 4 = 7", 0.5),  # the sum's own numbers are not candidates
        ("7 is the answer.", 0.5),  # the right number inside a short sentence
        ("The answer is 7 apples", 0.5),
        ("7.\n\nBecause 3 + 4 = 7", 0.5),
        ("Here is how:\n7", 0.0),
        ("1 2 3 4 5 6 7 8 9 7", 0.0),  # long: listing candidates earns nothing
        ("The sum of three and four, which you asked me about, is 7", 0.0),  # over SHORT_WORDS
        ("", 0.0),
        ("17", 0.0),
        ("70", 0.0),
        ("-7", 0.0),
        ("7.5", 0.0),
        ("3 + 4 = 8", 0.0),
        # Negations: the right number, denied.
        ("It is not 7", 0.0),
        ("It isn't 8, it is 7", 0.0),
        ("No, 7", 0.0),
        ("7 is wrong", 0.0),
        # Hedges and lists of candidates: none commits to the answer.
        ("7 or 8", 0.0),
        ("6 or 7", 0.0),
        ("Either 6 or 7", 0.0),
        ("7, 8", 0.0),
        ("7-8", 0.0),
        ("6/7", 0.0),
        ("maybe 7", 0.0),
        ("probably 7", 0.0),
        ("about 7", 0.0),
        ("7?", 0.0),
        ("7 7", 0.0),
        ("7\n8", 0.0),  # another bare answer on a later line
    ],
)
def test_the_answer_check_grades_the_reply(reply, reward):
    assert grade(reply, "7") == reward
    assert passed(reward) == (reward == 1.0)  # partial credit is reward, not a pass


def test_held_out_tasks_share_nothing_with_the_training_prompts(tmp_path):
    split = generate(list(FAMILIES), 20, 10, seed=3)
    assert len(split.train) == len(split.held_out) * 2 == 20 * len(FAMILIES)
    assert {t["family"] for t in split.held_out} == set(FAMILIES)
    train_prompts = " ".join(t["prompt"] for t in split.train)
    pairs = {tuple(map(int, t["task_id"].split("-")[1:])) for t in split.train if t["family"] == "add"}
    sums = {a + b for a, b in pairs}
    for task in split.held_out:
        assert task["prompt"] not in train_prompts
        if task["family"] == "add":  # neither the pair, its commuted twin nor its answer is trained on
            a, b = map(int, task["task_id"].split("-")[1:])
            assert (a, b) not in pairs and (b, a) not in pairs and a + b not in sums
        else:  # none of its file names and words is in any training prompt
            items = ITEMS[task["family"]](task["prompt"])
            assert items and not [item for item in items if item in train_prompts], task
    leaked = TaskSplit(split.train, [*split.held_out, split.train[0]])
    with pytest.raises(ValueError, match="also a training task"):
        check_split(leaked)
    a, b = next(map(int, t["task_id"].split("-")[1:]) for t in split.train if t["family"] == "add")
    twin = TaskSplit(split.train, [*split.held_out, add_task(b, a)] if a != b else split.held_out)
    with pytest.raises(ValueError, match="commuted twin or its answer"):
        check_split(twin if a != b else TaskSplit(split.train, [*split.held_out, add_task(a + b, 0)]))


ITEMS = {  # the names and words of a file task's prompt
    "write": lambda p: [p.split()[3], p.split()[-1]],
    "append": lambda p: [p.split()[3], p.split()[-1].rstrip(".")],
    "rename": lambda p: [p.split()[3], p.split()[-1].rstrip(".")],
    "fix": lambda p: [p.split()[3].rstrip(","), p.split()[-3], p.split()[-1].rstrip(".")],
}

EDITOR = """import re, sys
from pathlib import Path
prompt, index = sys.argv[1], int(sys.argv[2])
if index == 1:
    sys.exit(0)  # does nothing
if m := re.fullmatch(r"Create a file (\\S+) that contains the single line: (\\S+)", prompt):
    Path(m[1]).write_text(m[2] + ("\\n" if index == 0 else "x\\n"))
elif m := re.fullmatch(r"Append the line (\\S+) to the end of the file (\\S+)\\.", prompt):
    path = Path(m[2])
    path.write_text(path.read_text() + m[1] + "\\n" if index == 0 else m[1] + "\\n")  # 2: overwrites
elif m := re.fullmatch(r"Rename the file (\\S+) to (\\S+)\\.", prompt):
    if index == 0:
        Path(m[1]).rename(m[2])
    else:  # 2: copies, leaving the old name
        Path(m[2]).write_text(Path(m[1]).read_text())
elif m := re.fullmatch(r"In the file (\\S+), replace the word (\\S+) with (\\S+)\\.", prompt):
    path = Path(m[1])
    path.write_text(path.read_text().replace(m[2], m[3] if index == 0 else m[3] + " " + m[2]))
"""


def test_each_file_familys_check_passes_the_edit_asked_for_and_fails_a_wrong_one_or_none(tmp_path):
    """The real runner and a `cmd:` harness that edits by session index: the edit the prompt asks for, nothing, a
    near miss (an extra character, an overwrite, a copy instead of a rename, the old word kept) — graded 1.0, 0.0,
    0.0 on every file family, in workspaces its `workspace.setup` prepared."""
    split = generate(list(FAMILIES[1:]), 2, 1, seed=1)
    train, _ = write_split(split, tmp_path / "tasks")
    program = shlex.quote(EDITOR.replace("{", "{{").replace("}", "}}"))
    rollout = Rollout(
        load_tasks(train),
        HarnessSpec(f"cmd:{sys.executable} -c {program} {{prompt}} {{index}}"),
        GatewayEndpoints("http://127.0.0.1:9"),  # the harness calls no model
        RolloutConfig(group_size=3, concurrency=3, workspace_root=tmp_path / "ws", log_dir=tmp_path / "logs"),
    )
    rewards = sorted((s.task.task_id, s.index, s.reward) for s in asyncio.run(rollout.run()).sessions)
    expected = [(t["task_id"], i, r) for t in split.train for i, r in enumerate((1.0, 0.0, 0.0))]
    assert rewards == sorted(expected)


def test_the_same_seed_writes_the_same_files_and_the_cli_refuses_bad_input_in_one_line(tmp_path):
    cli = [sys.executable, "-m", "polar_mitm", "tasks", "generate", "--family", "add,write"]
    for name in ("a", "b"):
        done = subprocess.run(
            [*cli, "-o", str(tmp_path / name), "--seed", "5"], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
    for name in ("train.jsonl", "held_out.jsonl"):
        # The folder is nowhere in the files: the check runs from the package, not from a file beside them.
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    assert not (tmp_path / "a" / "answer_check.py").exists()
    tasks = load_tasks(tmp_path / "a" / "train.jsonl")
    assert len(tasks) == 32 and tasks[0].workspace_dir == tmp_path / "a" / "workspace"
    other = generate(["add"], 16, 8, seed=6)
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
    split = generate(["add"], 2, 1, seed=0)
    train, _ = write_split(split, tmp_path / "tasks")
    # The program goes in its command line (braces doubled for the template): the session's sandbox shows it
    # nothing of this test's folder.
    program = shlex.quote(ANSWERER.replace("{", "{{").replace("}", "}}"))
    rollout = Rollout(
        load_tasks(train),
        HarnessSpec(f"cmd:{sys.executable} -c {program} {{prompt}} {{index}}"),
        GatewayEndpoints("http://127.0.0.1:9"),  # the harness calls no model
        RolloutConfig(group_size=4, concurrency=4, workspace_root=tmp_path / "ws", log_dir=tmp_path / "logs"),
    )
    summary = asyncio.run(rollout.run())
    rewards = sorted((s.task.task_id, s.index, s.reward) for s in summary.sessions)
    expected = [(t["task_id"], i, r) for t in split.train for i, r in enumerate((1.0, 0.5, 0.0, 0.0))]
    assert rewards == sorted(expected)


TAMPERER = """import os, re, sys
from pathlib import Path
# Every answer_check.py it can find in the task folder and the run's workspaces becomes `print(1.0)`; a copy and a
# polar_mitm/ package in its own workspace (the check's directory) try to stand in for the real one.
for top in (Path(sys.argv[1]), Path.cwd().parent):
    for folder, _, files in os.walk(top):
        for name in files:
            if name == "answer_check.py":
                (Path(folder) / name).write_text("print(1.0)\\n")
(Path(sys.argv[1]) / "answer_check.py").write_text("print(1.0)\\n")
shadow = Path("polar_mitm/rollout")
shadow.mkdir(parents=True)
for init in (Path("polar_mitm/__init__.py"), shadow / "__init__.py"):
    init.write_text("")
(shadow / "answer_check.py").write_text("print(1.0)\\n")
Path("answer_check.py").write_text("print(1.0)\\n")
a, b = map(int, re.match(r"What is (\\d+) \\+ (\\d+)", sys.argv[2]).groups())
print(a + b + 1)  # wrong
"""


def rollout_rewards(tasks: Path, harness: str, tmp_path: Path, name: str) -> list[tuple[str, int, float]]:
    rollout = Rollout(
        load_tasks(tasks),
        HarnessSpec(harness),
        GatewayEndpoints("http://127.0.0.1:9"),  # the harness calls no model
        RolloutConfig(
            group_size=4,
            concurrency=4,
            workspace_root=tmp_path / name / "ws",
            log_dir=tmp_path / name / "logs",
            # Unconfined: the check must survive an agent that reaches the task folder even without a sandbox.
            sandbox="none",
        ),
    )
    return sorted((s.task.task_id, s.index, s.reward) for s in asyncio.run(rollout.run()).sessions)


def test_an_agent_that_overwrites_every_answer_check_it_finds_still_scores_zero_and_later_runs_are_unaffected(
    tmp_path,
):
    split = generate(["add"], 2, 1, seed=0)
    train, _ = write_split(split, tmp_path / "tasks")
    tamperer, answerer = tmp_path / "tamper.py", tmp_path / "answer.py"
    tamperer.write_text(TAMPERER)
    answerer.write_text(ANSWERER)
    hostile = rollout_rewards(
        train, f"cmd:{sys.executable} {tamperer} {tmp_path / 'tasks'} {{prompt}}", tmp_path, "hostile"
    )
    assert hostile == sorted((t["task_id"], i, 0.0) for t in split.train for i in range(4))
    # A later run on the same folder grades as a fresh one: 1.0, 0.5, 0.0, 0.0 by session index.
    later = rollout_rewards(train, f"cmd:{sys.executable} {answerer} {{prompt}} {{index}}", tmp_path, "later")
    assert later == sorted(
        (t["task_id"], i, r) for t in split.train for i, r in enumerate((1.0, 0.5, 0.0, 0.0))
    )
