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
- `write`: "Create a file NAME that contains the single line: WORD" — checked in the workspace (exit code), with
  the harness's own tools.

The split: each family's items (the (A, B) pairs; the names and the words) are shuffled with the seed and cut
once, so held-out tasks use pairs, names and words no training prompt contains (`check_split` proves it on the
written prompts; the loop's `check_held_out` also refuses a shared task id). Everything is a pure function of
(families, sizes, seed): the same command writes the same files.
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

FAMILIES = ("add", "write")
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
    return {
        "task_id": f"write-{name.split('.')[0]}-{word}",
        "prompt": f"Create a file {name} that contains the single line: {word}",
        "workspace": {"dir": WORKSPACE_DIR},
        "eval": {"command": f'test "$(cat {name} 2>/dev/null)" = {word}'},
        "timeouts": TIMEOUTS,
        "family": "write",
    }


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
    for family in families:
        if family == "add":
            pairs = [(a, b) for a in range(ADD_MAX + 1) for b in range(ADD_MAX + 1)]
            train_pool, held_pool = _cut(pairs, held_out_share, rng)
            make = [add_task(a, b) for a, b in train_pool], [add_task(a, b) for a, b in held_pool]
        else:
            train_names, held_names = _cut(list(NAMES), held_out_share, rng)
            train_words, held_words = _cut(list(WORDS), held_out_share, rng)
            make = (
                [write_task(n, w) for n, w in _pairs(train_names, train_words, rng)],
                [write_task(n, w) for n, w in _pairs(held_names, held_words, rng)],
            )
        for pool, wanted, out in ((make[0], train, split.train), (make[1], held_out, split.held_out)):
            if wanted > len(pool):
                raise ValueError(f"{family}: {wanted} tasks asked, the split has {len(pool)}")
            out += pool[:wanted]
    check_split(split)
    return split


def _pairs(names: list[str], words: list[str], rng: random.Random) -> list[tuple[str, str]]:
    pairs = [(n, w) for n in names for w in words]
    rng.shuffle(pairs)
    return pairs


def check_split(split: TaskSplit) -> None:
    """No held-out prompt appears in a training prompt, no held-out (A, B) pair or (NAME, WORD) is trained on, and
    no held-out file name or word appears in any training prompt; no task id is in both splits."""
    train_prompts = [t["prompt"] for t in split.train]
    trained_items = {_items(t["prompt"]) for t in split.train}
    trained_words = {word for p in train_prompts for word in re.findall(r"[\w.]+", p)}
    for task in split.held_out:
        prompt, items = task["prompt"], _items(task["prompt"])
        if items in trained_items or any(prompt in p for p in train_prompts):
            raise ValueError(f"held-out task {task['task_id']} is also a training task")
        if task.get("family") == "write" and (leaked := set(items) & trained_words):
            raise ValueError(f"held-out task {task['task_id']}: {sorted(leaked)} appear in training prompts")
    shared = {t["task_id"] for t in split.train} & {t["task_id"] for t in split.held_out}
    if shared:
        raise ValueError(f"task ids in both splits: {sorted(shared)}")


def _items(prompt: str) -> tuple[str, ...]:
    """What tells a generated prompt from the others of its family: (A, B), or (NAME, WORD)."""
    if match := re.fullmatch(r"What is (\d+) \+ (\d+)\? Reply with the number only\.", prompt):
        return match.groups()
    if match := re.fullmatch(r"Create a file (\S+) that contains the single line: (\S+)", prompt):
        return match.groups()
    return (prompt,)


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
