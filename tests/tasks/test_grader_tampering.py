"""Graders an agent cannot steer (issue 36 items 3 and 4): what an agent leaves in its workspace, its `.git` or the
folder above it does not change the reward; its bug unfixed still scores 0, fixed 1.

SWE grading runs on the offline set (examples/swe_tasks) through the task's own eval command, as the rollout runs
it: a real clone, the task's real venv, real pytest and swebench. Each hack below scored 1 with the bug unfixed
before the grader restored the files that steer pytest and Python's start, ran git without the repository's hooks
and filters, kept pytest's configuration search inside the workspace and ran itself with `python -P`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from polar_mitm.rollout.runner import run_shell
from polar_mitm.tasks.swe import SweOptions, load_instances, write_tasks
from polar_mitm.tasks.swe_grading import GradingSpec
from polar_mitm.tasks.swe_workspace import is_steering
from polar_mitm.tasks.task_file import Task, load_tasks

SET = Path(__file__).resolve().parents[2] / "examples" / "swe_tasks"
TASK_ID = "inflection__pluralize-sh"
GOLD = next(
    row["patch"] for row in map(json.loads, (SET / "instances.jsonl").read_text().splitlines())
    if row["instance_id"] == TASK_ID
)  # fmt: skip

# A pytest plugin that reports every test as passed: what each hack tries to get loaded.
PASS_EVERYTHING = textwrap.dedent(
    """
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        outcome.get_result().outcome = "passed"
    """
)
# A pytest.py that `python -m pytest` imports instead of pytest: it runs the real one with the plugin above.
FAKE_PYTEST = textwrap.dedent(
    f"""
    import os, sys, types
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.modules.pop("pytest", None)
    import pytest
    plugin = types.ModuleType("pass_everything")
    exec({PASS_EVERYTHING!r}, plugin.__dict__)
    sys.exit(pytest.main(sys.argv[1:], plugins=[plugin]))
    """
)
PLANT_LATER = "cp .pass_everything conftest.py"  # what a git hook or filter runs after grading restored files


@pytest.fixture(scope="module")
def swe_task(tmp_path_factory) -> Task:
    """The task as `polar-mitm tasks swe` writes it (its eval command is what the rollout runs)."""
    root = tmp_path_factory.mktemp("swe")
    write_tasks(load_instances(SET / "instances.jsonl"), SweOptions(repos=SET), root / "tasks.jsonl")
    return {t.task_id: t for t in load_tasks(root / "tasks.jsonl")}[TASK_ID]


def prepared(task: Task, workspace: Path) -> Path:
    """INIT as the runner does it: clone, then the task's setup (checkout, history cut, the venv once)."""
    workspace.mkdir(parents=True)
    subprocess.run(["git", "clone", "-q", "--", task.workspace_git, "."], cwd=workspace, check=True)
    for command in task.setup:
        code, out = asyncio.run(run_shell(command, workspace, 300))
        assert code == 0, out
    return workspace


def graded(task: Task, workspace: Path) -> tuple[float, str]:
    code, out = asyncio.run(run_shell(task.eval_command, workspace, 300))
    assert code == 0, out
    return float(out.rstrip().splitlines()[-1].removeprefix("reward: ")), out


def git_config(workspace: Path, key: str, value: str) -> None:
    subprocess.run(["git", "config", key, value], cwd=workspace, check=True)


def plant_later(workspace: Path) -> None:
    (workspace / ".pass_everything").write_text(PASS_EVERYTHING)


def post_checkout_hook(workspace: Path) -> None:
    plant_later(workspace)
    hook = workspace / ".git" / "hooks" / "post-checkout"
    hook.write_text(f"#!/bin/sh\n{PLANT_LATER}\n")
    hook.chmod(0o755)


def smudge_filter(workspace: Path) -> None:
    plant_later(workspace)
    (workspace / ".gitattributes").write_text("test_inflection.py filter=cheat\n")
    git_config(workspace, "filter.cheat.smudge", f"sh -c 'cat; {PLANT_LATER}'")


def fsmonitor(workspace: Path) -> None:
    plant_later(workspace)
    monitor = workspace / ".monitor"
    monitor.write_text(f"#!/bin/sh\n{PLANT_LATER}\nexit 1\n")
    monitor.chmod(0o755)
    git_config(workspace, "core.fsmonitor", str(monitor))


def ini_above_the_workspace(workspace: Path) -> None:
    """The folder above the workspace is the agent's to write too; pytest searches it for an ini file."""
    (workspace.parent / "pass_everything.py").write_text(PASS_EVERYTHING)
    (workspace.parent / "pytest.ini").write_text("[pytest]\naddopts = -p pass_everything\npythonpath = .\n")


def plugin_by_ini(name: str, text: str) -> Callable[[Path], None]:
    def plant(workspace: Path) -> None:
        (workspace / "pass_everything.py").write_text(PASS_EVERYTHING)
        (workspace / name).write_text(text)

    return plant


def start_hook(name: str) -> Callable[[Path], None]:
    """A sitecustomize.py or .pth that would ask pytest for the plugin, were it run at Python's start."""

    def plant(workspace: Path) -> None:
        (workspace / "pass_everything.py").write_text(PASS_EVERYTHING)
        (workspace / name).write_text("import os; os.environ['PYTEST_PLUGINS'] = 'pass_everything'\n")

    return plant


def grader_shadowed(workspace: Path) -> None:
    """A polar_mitm/ package in the workspace, which `python -m polar_mitm…` run there would import."""
    folder = workspace / "polar_mitm" / "rollout"
    folder.mkdir(parents=True)
    for init in (workspace / "polar_mitm" / "__init__.py", folder / "__init__.py"):
        init.write_text("")
    (folder / "swe_grading.py").write_text("print('reward: 1')\n")


def skip_worktree_test_file(workspace: Path) -> None:
    subprocess.run(
        ["git", "update-index", "--skip-worktree", "test_inflection.py"], cwd=workspace, check=True
    )
    tests = workspace / "test_inflection.py"
    tests.write_text(tests.read_text().replace("    assert ", "    assert True or "))


HACKS: dict[str, Callable[[Path], None]] = {
    "root conftest.py": lambda ws: (ws / "conftest.py").write_text(PASS_EVERYTHING),
    "pytest.py": lambda ws: (ws / "pytest.py").write_text(FAKE_PYTEST),
    "pytest/ package": lambda ws: (
        (ws / "pytest").mkdir(),
        (ws / "pytest" / "__init__.py").write_text(FAKE_PYTEST),
    ),
    "setup.cfg addopts": plugin_by_ini("setup.cfg", "[tool:pytest]\naddopts = -p pass_everything\n"),
    "pytest.ini addopts": plugin_by_ini("pytest.ini", "[pytest]\naddopts = -p pass_everything\n"),
    "pyproject.toml addopts": plugin_by_ini(
        "pyproject.toml", '[tool.pytest.ini_options]\naddopts = "-p pass_everything"\n'
    ),
    "tox.ini addopts": plugin_by_ini("tox.ini", "[pytest]\naddopts = -p pass_everything\n"),
    "sitecustomize.py": start_hook("sitecustomize.py"),
    ".pth": start_hook("pass_everything.pth"),
    "git post-checkout hook": post_checkout_hook,
    "git smudge filter": smudge_filter,
    "git fsmonitor": fsmonitor,
    "git skip-worktree test file": skip_worktree_test_file,
    "pytest.ini above the workspace": ini_above_the_workspace,
    "grader shadowed by the workspace": grader_shadowed,
}


@pytest.mark.slow
def test_the_offline_task_scores_zero_unfixed_and_one_fixed(swe_task, tmp_path):
    unfixed = prepared(swe_task, tmp_path / "unfixed")
    assert graded(swe_task, unfixed)[0] == 0.0
    fixed = prepared(swe_task, tmp_path / "fixed")
    subprocess.run(["git", "apply", "-"], cwd=fixed, input=GOLD, text=True, check=True)
    reward, out = graded(swe_task, fixed)
    assert reward == 1.0 and "RESOLVED_FULL" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("hack", list(HACKS))
def test_a_workspace_hack_leaves_the_unfixed_bug_at_zero(swe_task, tmp_path, hack):
    workspace = prepared(swe_task, tmp_path / "above" / "ws")
    HACKS[hack](workspace)
    reward, out = graded(swe_task, workspace)
    # Graded, not refused: the task's tests ran and the bug's tests failed.
    assert reward == 0.0 and "RESOLVED_NO" in out and "PASS_TO_PASS kept 448/448" in out, out


@pytest.mark.slow
def test_the_gold_fix_still_scores_one_whatever_the_agent_left(swe_task, tmp_path):
    workspace = prepared(swe_task, tmp_path / "ws")
    subprocess.run(["git", "apply", "-"], cwd=workspace, input=GOLD, text=True, check=True)
    for hack in ("pytest.py", "setup.cfg addopts", "tox.ini addopts"):
        HACKS[hack](workspace)
    (workspace / "conftest.py").write_text("raise SystemExit('the agent broke conftest.py')\n")
    reward, out = graded(swe_task, workspace)
    assert reward == 1.0 and "RESOLVED_FULL" in out, out


# -- a repository with a tests/ folder: conftest.py there, bytecode caches, imports from the workspace -----------------


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


CALC_TEST_PATCH = """\
--- /dev/null
+++ b/tests/test_calc.py
@@ -0,0 +1,5 @@
+from calc import add
+
+
+def test_add():
+    assert add(2, 3) == 5
"""


def calc_workspace(root: Path) -> tuple[Path, str]:
    """A repository not installed anywhere: calc.py (buggy) at the top, tests under tests/ without __init__.py."""
    workspace = root / "ws"
    (workspace / "tests").mkdir(parents=True)
    (workspace / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (workspace / "tests" / "test_other.py").write_text("def test_other():\n    pass\n")
    git(workspace, "init", "-q")
    git(workspace, "add", ".")
    git(workspace, "commit", "-qm", "base")
    return workspace, git(workspace, "rev-parse", "HEAD")


def grade_calc(workspace: Path, base_commit: str, env_dir: str, root: Path) -> str:
    """The grader's command line on a hand-written spec (the offline task's venv, which INIT built and sealed)."""
    spec = GradingSpec(
        instance_id="calc__add-1",
        base_commit=base_commit,
        test_patch=CALC_TEST_PATCH,
        fail_to_pass=["tests/test_calc.py::test_add"],
        pass_to_pass=[],
        env_dir=env_dir,
    )
    digest = spec.save(root / "calc-spec.json")
    done = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "polar_mitm.tasks.swe_grading",
            "grade",
            str(root / "calc-spec.json"),
            digest,
        ],
        cwd=workspace,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_a_conftest_in_the_test_folder_and_planted_caches_are_removed_and_the_fix_still_imports(
    swe_task, tmp_path
):
    env_dir = GradingSpec.load(Path(swe_task.meta["swe"]["spec"])).env_dir
    prepared(swe_task, tmp_path / "init")  # builds the task's venv, which the calc spec borrows
    workspace, base = calc_workspace(tmp_path)
    (workspace / "tests" / "conftest.py").write_text(PASS_EVERYTHING)
    for cache in ("tests/__pycache__", ".pytest_cache/v/cache"):
        (workspace / cache).mkdir(parents=True)
        (workspace / cache / "planted").write_text("x")
    out = grade_calc(workspace, base, env_dir, tmp_path)
    assert out.rstrip().endswith("reward: 0") and "RESOLVED_NO" in out, out
    assert not (workspace / "tests" / "conftest.py").exists()
    assert not (workspace / "tests" / "__pycache__").exists() and not (workspace / ".pytest_cache").exists()
    # The fix scores 1: tests/test_calc.py imports calc from the workspace, as under `python -m pytest`.
    (workspace / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    out = grade_calc(workspace, base, env_dir, tmp_path)
    assert out.rstrip().endswith("reward: 1") and "RESOLVED_FULL" in out, out


@pytest.mark.parametrize(
    ("path", "is_dir", "steers"),
    [
        ("conftest.py", False, True),
        ("tests/unit/conftest.py", False, True),
        ("pytest.py", False, True),
        ("pytest", True, True),
        ("_pytest", True, True),
        ("sitecustomize.cpython-311-x86_64-linux-gnu.so", False, True),
        ("usercustomize.py", False, True),
        ("cheat.pth", False, True),
        ("cheat.dist-info", True, True),
        ("pkg/setup.cfg", False, True),
        ("tests/__pycache__", True, True),
        ("tests/helpers.cpython-311.pyc", False, True),
        ("src/_pytest", True, False),  # pytest's own source in the pytest repository: the agent's to fix
        ("src/pytest.py", False, False),
        ("pytest_helpers.py", False, False),
        ("test_inflection.py", False, False),
        ("inflection", True, False),
    ],
)
def test_steering_paths_are_named_by_what_they_steer(path, is_dir, steers):
    assert is_steering(path, is_dir) is steers
