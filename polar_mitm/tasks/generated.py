"""Generated task families with a held-out split (`polar-mitm tasks generate`), sized for a small model.

Why: learning through a real harness needs tasks the model can sometimes do — GRPO learns only from differences
inside a group — and held-out tasks it never trains on, to tell learning from memorising. Base SmolLM2-135M makes
no parsed tool call through Pi's or Aider's prompts (0 of 24 samples each, measured here), so a file task alone
gives it nothing to learn from; it does answer small sums, mostly wordily ("3 + 4 equals 7.").

Families (each task's own check grades it):

- `add`: "What is A + B? Reply with the number only." — graded on the harness's final answer by
  `polar_mitm.tasks.answer_check`, run from the installed package (1.0 the number alone, 0.5 a short reply
  whose only number it is, 0.0 otherwise, negations and lists of candidates included); A, B in 0..ADD_MAX.
  Nothing in the task folder is run: a check script there was one an agent could replace for every later run.
- File tasks, each checked in the workspace (exit code) once the harness's own tools have acted; the files a task
  starts from are made by its `workspace.setup`:
  - `write`: "Create a file NAME that contains the single line: WORD";
  - `append`: "Append the line WORD to the end of the file NAME." (NAME holds `first line`);
  - `rename`: "Rename the file OLD to NEW." (OLD holds `keep me`; NEW must, and OLD must be gone);
  - `fix`: "In the file NAME, replace the word WRONG with RIGHT." (NAME holds `The WRONG is ready.`).

The split: the sums, and the file names and words every file family draws from, are shuffled with the seed and cut
once, so held-out tasks use sums (hence no commuted twin: A + B is B + A), names and words no training prompt
contains or answers (`check_split` proves it on the written prompts; the loop's `check_held_out` also refuses a shared
task id). Everything is a pure function of (families, sizes, seed): the same command writes the same files.
"""

from __future__ import annotations

import json
import random
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_mitm.tasks import answer_check

FAMILIES = ("add", "write", "append", "rename", "fix")
FILE_FAMILIES = FAMILIES[1:]
ADD_MAX = 9
NAMES = (
    "out.txt", "note.txt", "todo.txt", "word.txt", "answer.txt", "memo.txt", "list.txt", "data.txt",
    "result.txt", "hello.txt", "item.txt", "line.txt", "value.txt", "entry.txt", "name.txt", "text.txt",
)  # fmt: skip
WORDS = (
    "apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon", "ocean", "maple", "candle", "silver",
    "garden", "rocket", "butter", "window", "forest", "planet", "pencil", "summer", "bridge", "orange", "castle",
    "marble",
)  # fmt: skip
TIMEOUTS = {"init": 30, "run": 300, "eval": 30}
# The add tasks' check, run from the package with -P (the workspace, the command's directory, is not on sys.path).
CHECK_COMMAND = f"{shlex.quote(sys.executable)} -P -m {answer_check.__name__}"
STALE_CHECK_FILE = "answer_check.py"  # the copy older versions put beside the task files (and ran from there)
WORKSPACE_DIR = "workspace"  # an empty directory every session starts from


@dataclass(frozen=True)
class TaskSplit:
    train: list[dict[str, Any]]
    held_out: list[dict[str, Any]]


def _cut(items: list[Any], held_out_share: float, rng: random.Random) -> tuple[list[Any], list[Any]]:
    shuffled = list(items)
    rng.shuffle(shuffled)
    cut = max(1, round(len(shuffled) * held_out_share))
    return shuffled[cut:], shuffled[:cut]


def add_task(a: int, b: int) -> dict[str, Any]:
    return {
        "task_id": f"add-{a}-{b}",
        "prompt": f"What is {a} + {b}? Reply with the number only.",
        "workspace": {"dir": WORKSPACE_DIR},
        "eval": {"command": f"{CHECK_COMMAND} {a + b}", "reward": "stdout"},
        "timeouts": TIMEOUTS,
        "family": "add",
    }


def write_task(name: str, word: str) -> dict[str, Any]:
    return file_task(
        "write",
        f"write-{stem(name)}-{word}",
        f"Create a file {name} that contains the single line: {word}",
        check=f'test "$(cat {name} 2>/dev/null)" = {word}',
    )


APPEND_FIRST_LINE = "first line"
RENAME_CONTENT = "keep me"


def append_task(name: str, word: str) -> dict[str, Any]:
    return file_task(
        "append",
        f"append-{stem(name)}-{word}",
        f"Append the line {word} to the end of the file {name}.",
        setup=[f"printf '%s\\n' {shlex.quote(APPEND_FIRST_LINE)} > {name}"],
        check=f'test "$(cat {name} 2>/dev/null)" = "$(printf \'%s\\n%s\' {shlex.quote(APPEND_FIRST_LINE)} {word})"',
    )


def rename_task(old: str, new: str) -> dict[str, Any]:
    return file_task(
        "rename",
        f"rename-{stem(old)}-{stem(new)}",
        f"Rename the file {old} to {new}.",
        setup=[f"printf '%s\\n' {shlex.quote(RENAME_CONTENT)} > {old}"],
        check=f'test ! -e {old} && test "$(cat {new} 2>/dev/null)" = {shlex.quote(RENAME_CONTENT)}',
    )


def fix_task(name: str, wrong: str, right: str) -> dict[str, Any]:
    return file_task(
        "fix",
        f"fix-{stem(name)}-{wrong}-{right}",
        f"In the file {name}, replace the word {wrong} with {right}.",
        setup=[f"printf '%s\\n' 'The {wrong} is ready.' > {name}"],
        check=f"test \"$(cat {name} 2>/dev/null)\" = 'The {right} is ready.'",
    )


def file_task(family: str, task_id: str, prompt: str, *, check: str, setup: list[str] | None = None) -> dict:
    """A file task: the empty workspace (plus the files `setup` makes), graded by `check`'s exit code."""
    return {
        "task_id": task_id,
        "prompt": prompt,
        "workspace": {"dir": WORKSPACE_DIR, **({"setup": setup} if setup else {})},
        "eval": {"command": check},
        "timeouts": TIMEOUTS,
        "family": family,
    }


def stem(name: str) -> str:
    return name.split(".")[0]


def generate(
    families: list[str], train: int, held_out: int, seed: int, held_out_share: float = 0.3
) -> TaskSplit:
    """`train` and `held_out` tasks per family, drawn from disjoint item pools (see the module docstring)."""
    unknown = set(families) - set(FAMILIES)
    if unknown or not families:
        raise ValueError(
            f"families must be among {', '.join(FAMILIES)} (got {', '.join(families) or 'none'})"
        )
    rng = random.Random(seed)
    split = TaskSplit([], [])
    names = words = (
        None  # cut once, at the first file family: every file family draws from the same two sides
    )
    for family in families:
        if family == "add":
            train_pool, held_pool = _add_pools(held_out_share, rng)
            make = [add_task(a, b) for a, b in train_pool], [add_task(a, b) for a, b in held_pool]
        else:
            if names is None:
                names = _cut(list(NAMES), held_out_share, rng)
                words = _cut(list(WORDS), held_out_share, rng)
            make = (
                _file_tasks(family, names[0], words[0], rng),
                _file_tasks(family, names[1], words[1], rng),
            )
        for pool, wanted, out in ((make[0], train, split.train), (make[1], held_out, split.held_out)):
            if wanted > len(pool):
                raise ValueError(f"{family}: {wanted} tasks asked, the split has {len(pool)}")
            out += pool[:wanted]
    check_split(split)
    return split


def _add_pools(held_out_share: float, rng: random.Random) -> tuple[list, list]:
    """(A, B) pairs cut by their sum: whole sums are held out (in a shuffled order, until the share of pairs is
    reached), so a held-out task's answer is no training task's answer, and its commuted twin (B, A) is held out
    with it."""
    by_sum: dict[int, list[tuple[int, int]]] = {}
    for a in range(ADD_MAX + 1):
        for b in range(ADD_MAX + 1):
            by_sum.setdefault(a + b, []).append((a, b))
    sums = list(by_sum)
    rng.shuffle(sums)
    wanted = max(1, round((ADD_MAX + 1) ** 2 * held_out_share))
    held: list[tuple[int, int]] = []
    train: list[tuple[int, int]] = []
    for total in sums:
        (held if len(held) < wanted else train).extend(by_sum[total])
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


def _file_tasks(family: str, names: list[str], words: list[str], rng: random.Random) -> list[dict[str, Any]]:
    """Every task of a file family from one side's names and words, shuffled."""
    if family == "write":
        tasks = [write_task(n, w) for n in names for w in words]
    elif family == "append":
        tasks = [append_task(n, w) for n in names for w in words]
    elif family == "rename":
        tasks = [rename_task(old, new) for old in names for new in names if old != new]
    else:
        tasks = [
            fix_task(n, wrong, right) for n in names for wrong in words for right in words if wrong != right
        ]
    rng.shuffle(tasks)
    return tasks


def check_split(split: TaskSplit) -> None:
    """No held-out prompt appears in a training prompt; no held-out (A, B) pair, its twin (B, A) or its sum, and no
    file task's items, are trained on; no held-out file name or word appears in any training prompt; no task id is
    in both splits."""
    train_prompts = [t["prompt"] for t in split.train]
    trained_items = {prompt_items(t["prompt"]) for t in split.train}
    trained_words = {word for p in train_prompts for word in re.findall(r"[\w.]+", p)}
    trained_sums = {sum(map(int, prompt_items(t["prompt"]))) for t in split.train if t.get("family") == "add"}
    for task in split.held_out:
        prompt, items = task["prompt"], prompt_items(task["prompt"])
        if items in trained_items or any(prompt in p for p in train_prompts):
            raise ValueError(f"held-out task {task['task_id']} is also a training task")
        if task.get("family") == "add" and (
            items[::-1] in trained_items or sum(map(int, items)) in trained_sums
        ):
            raise ValueError(
                f"held-out task {task['task_id']}: its commuted twin or its answer is a training task's"
            )
        if task.get("family") in FILE_FAMILIES and (leaked := set(items) & trained_words):
            raise ValueError(f"held-out task {task['task_id']}: {sorted(leaked)} appear in training prompts")
    shared = {t["task_id"] for t in split.train} & {t["task_id"] for t in split.held_out}
    if shared:
        raise ValueError(f"task ids in both splits: {sorted(shared)}")


def prompt_items(prompt: str) -> tuple[str, ...]:
    """What tells a generated prompt from the others of its family: (A, B), or (NAME, WORD)."""
    if match := re.fullmatch(r"What is (\d+) \+ (\d+)\? Reply with the number only\.", prompt):
        return match.groups()
    for pattern in ITEM_PATTERNS:
        if match := re.fullmatch(pattern, prompt):
            return match.groups()
    return (prompt,)


ITEM_PATTERNS = (
    r"Create a file (\S+) that contains the single line: (\S+)",
    r"Append the line (\S+) to the end of the file (\S+)\.",
    r"Rename the file (\S+) to (\S+)\.",
    r"In the file (\S+), replace the word (\S+) with (\S+)\.",
)


def write_split(split: TaskSplit, root: Path) -> tuple[Path, Path]:
    """ROOT/train.jsonl, ROOT/held_out.jsonl and the empty workspace; returns the two files.

    A check script an older version left in ROOT goes: no task runs it now, and nobody should by mistake.
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / WORKSPACE_DIR).mkdir(exist_ok=True)
    (root / STALE_CHECK_FILE).unlink(missing_ok=True)
    paths = root / "train.jsonl", root / "held_out.jsonl"
    for path, rows in zip(paths, (split.train, split.held_out), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths
