"""Grading a session as Harbor's verifier (and Polar's Harbor evaluator) does, once the agent has ended.

    1. the task's tests/ is copied into a fresh folder that the sandbox shows at /tests — only now, so the agent
       never saw the grader's files;
    2. `bash /tests/test.sh` runs in the workdir (the session's workspace, at eval.harbor.workdir) with the task's
       verifier env, under the verifier timeout (`timeouts.eval`);
    3. the reward is read from the session's logs folder, shown at /logs: `verifier/reward.txt` (one number) or,
       if there is none, `verifier/reward.json` (named numbers, combined by the task's `reward_rule`);
    4. it is accepted only if the verifier exited 0; otherwise the session gets the failure reward and the reason.

The caller owns the sandbox: `run(argv, cwd, timeout, env)` runs a command with the workspace at `cwd` and the two
folders given to `grade` at /tests and /logs (TESTS_MOUNT, LOGS_MOUNT), laying `env` over its own base
environment, and returns (exit code, output) or raises TimeoutError. `polar_mitm.tasks.harbor_check` has one made
with bwrap; the rollout's POST stage passes its session sandbox's.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from polar_mitm.tasks.task_file import HarborEval

TESTS_MOUNT = "/tests"
LOGS_MOUNT = "/logs"
REWARD_TEXT = "reward.txt"
REWARD_JSON = "reward.json"

RunCommand = Callable[[list[str], str, float, dict[str, str]], Awaitable[tuple[int, str]]]


class RewardFileError(ValueError):
    """A verifier's reward file that gives no reward (missing, not a number, or ambiguous for the rule)."""


@dataclass(frozen=True)
class HarborGrade:
    """The outcome of one verifier run: the reward, and why (or why not) it was accepted."""

    reward: float
    accepted: bool
    reason: str  # the rule that made the reward, or why the failure reward was given
    rewards: dict[str, float] = field(default_factory=dict)  # what the reward file named
    exit_code: int | None = None
    output: str = ""


def combine(rewards: dict[str, float], rule: str) -> float:
    """One reward from a reward file's named numbers, by the task's rule (`HarborSpec.reward_rule`)."""
    if not rewards:
        raise RewardFileError(f"{REWARD_JSON} names no rewards")
    if rule.startswith("key:"):
        name = rule.removeprefix("key:")
        if name not in rewards:
            raise RewardFileError(f"reward_rule {rule!r}: no {name!r} among {', '.join(sorted(rewards))}")
        return rewards[name]
    values = list(rewards.values())
    if rule == "only":
        if len(values) != 1:
            raise RewardFileError(
                f"{REWARD_JSON} names {len(values)} rewards ({', '.join(sorted(rewards))}): the task's "
                'reward_rule must say how to combine them ("mean", "min", "max", "sum" or "key:NAME")'
            )
        return values[0]
    combined = {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "sum": sum(values)}
    if rule not in combined:
        raise RewardFileError(f"unknown reward_rule {rule!r}")
    return combined[rule]


def read_rewards(verifier_dir: Path) -> dict[str, float]:
    """The named numbers the verifier wrote: reward.txt as {"reward": N} (Harbor reads it first), else reward.json."""
    text_file, json_file = verifier_dir / REWARD_TEXT, verifier_dir / REWARD_JSON
    if text_file.is_file():
        text = text_file.read_text(encoding="utf-8", errors="replace").strip()
        try:
            return {"reward": _number(float(text), REWARD_TEXT)}
        except ValueError:
            raise RewardFileError(f"{REWARD_TEXT} holds {text[:40]!r}, not a number") from None
    if not json_file.is_file():
        raise RewardFileError(f"the verifier wrote neither {REWARD_TEXT} nor {REWARD_JSON} in /logs/verifier")
    try:
        data = json.loads(json_file.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as exc:
        raise RewardFileError(f"{REWARD_JSON} is not JSON: {exc}") from None
    if isinstance(data, bool) or not isinstance(data, dict | int | float):
        raise RewardFileError(f"{REWARD_JSON} must be an object of named numbers")
    if not isinstance(data, dict):
        return {"reward": _number(data, REWARD_JSON)}
    return {str(name): _number(value, f"{REWARD_JSON} {name!r}") for name, value in data.items()}


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardFileError(f"{what} is {value!r}, not a finite number")
    return float(value)


def prepare(harbor: HarborEval, tests_dir: Path, logs_dir: Path) -> None:
    """A fresh copy of the task's tests and an empty logs/verifier: nothing a session left can be read as a grade."""
    if tests_dir.exists() and any(tests_dir.iterdir()):
        raise FileExistsError(f"{tests_dir} is not empty: the tests must be a fresh copy")
    if logs_dir.exists() and any(logs_dir.rglob("*")):
        raise FileExistsError(f"{logs_dir} is not empty: a reward left there could be read as the verifier's")
    tests_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(harbor.tests, tests_dir, symlinks=True, dirs_exist_ok=True)
    (logs_dir / "verifier").mkdir(parents=True, exist_ok=True)


async def grade(
    harbor: HarborEval,
    timeout: float,
    *,
    tests_dir: Path,
    logs_dir: Path,
    run: RunCommand,
    failure_reward: float = 0.0,
) -> HarborGrade:
    """Run the task's verifier after the agent and read its reward (see the module docstring for each step).

    `tests_dir` and `logs_dir` are host folders, empty or absent, that `run` shows at /tests and /logs.
    """
    prepare(harbor, tests_dir, logs_dir)
    try:
        code, output = await run(
            ["bash", f"{TESTS_MOUNT}/test.sh"], harbor.workdir, timeout, dict(harbor.env)
        )
    except TimeoutError:
        return HarborGrade(failure_reward, False, f"the verifier ran past its {timeout:g} s timeout")
    if code != 0:
        return HarborGrade(
            failure_reward, False, f"the verifier exited {code}", exit_code=code, output=output
        )
    try:
        rewards = read_rewards(logs_dir / "verifier")
        reward = combine(rewards, harbor.reward_rule)
    except RewardFileError as exc:
        return HarborGrade(failure_reward, False, str(exc), exit_code=code, output=output)
    return HarborGrade(reward, True, f"reward_rule {harbor.reward_rule}", rewards, code, output)
