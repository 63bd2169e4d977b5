"""Terminal-Bench 1 task folders (`task.yaml`) in Harbor's layout, so `polar-mitm tasks harbor` reads them too.

The older layout (terminal-bench ≤ 0.2 on PyPI; the package downloads its tasks, it ships none):

    task-name/
      task.yaml            instruction, author_*, difficulty, category, tags, parser_name (pytest),
                           max_agent_timeout_sec, max_test_timeout_sec, run_tests_in_same_shell…
      Dockerfile           at the top (the build context is the whole folder); docker-compose.yaml: service `client`
      run-tests.sh         copied with tests/ to /tests and run there with TEST_DIR=/tests (pytest's output graded)
      tests/               test_outputs.py and what it needs
      solution.sh          the oracle (solution.yaml, tmux keystrokes, is not converted)

`stage` writes it as a Harbor folder: task.toml from task.yaml; environment/ holding the build context without
the grader's files (task.yaml, run-tests.sh, tests/, solution.*), so a `COPY . /app` cannot show the agent its
tests or the solution; tests/ with run-tests.sh and a test.sh that runs it and grades its output as Terminal-Bench's
pytest parser does (every test in pytest's short summary PASSED, at least one) into /logs/verifier/reward.txt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

TASK_YAML = "task.yaml"
GRADER_FILES = {TASK_YAML, "run-tests.sh", "tests", "solution.sh", "solution.yaml", "docker-compose.yaml"}
KNOWN_FIELDS = {
    "instruction",
    "descriptions",
    "author_name",
    "author_email",
    "difficulty",
    "category",
    "tags",
    "parser_name",
    "max_agent_timeout_sec",
    "max_test_timeout_sec",
    "run_tests_in_same_shell",
    "disable_asciinema",
    "estimated_duration_sec",
    "expert_time_estimate_min",
    "junior_time_estimate_min",
}
DEFAULT_AGENT_TIMEOUT = 360.0  # terminal-bench's defaults for a task.yaml that names none
DEFAULT_TEST_TIMEOUT = 60.0

TEST_SH = """#!/bin/bash
# Made by polar-mitm from a Terminal-Bench 1 task: run-tests.sh, graded as its pytest parser grades.
mkdir -p /logs/verifier
TEST_DIR=/tests bash /tests/run-tests.sh > /logs/verifier/test-output.txt 2>&1
cat /logs/verifier/test-output.txt
python3 /tests/polar_pytest_reward.py /logs/verifier/test-output.txt > /logs/verifier/reward.txt
"""

PYTEST_REWARD = '''"""1 when pytest's short test summary lists tests and every one PASSED (Terminal-Bench's pytest parser), else 0."""

import re
import sys

text = open(sys.argv[1], errors="replace").read()
summary = text.split("short test summary info")[-1] if "short test summary info" in text else ""
statuses = re.findall(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\\s", summary, re.MULTILINE)
print(1 if statuses and all(status == "PASSED" for status in statuses) else 0)
'''


class TaskYamlError(ValueError):
    """A task.yaml that cannot be staged (the message names the file and field)."""


def is_task_yaml_folder(folder: Path) -> bool:
    return (folder / TASK_YAML).is_file() and not (folder / "task.toml").exists()


def stage(folder: Path, target: Path) -> list[str]:
    """Write the Terminal-Bench 1 task `folder` as a Harbor task folder `target`; returns warnings."""
    path = folder / TASK_YAML
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise TaskYamlError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(spec, dict):
        raise TaskYamlError(f"{path}: a mapping of fields expected")
    if unknown := sorted(set(spec) - KNOWN_FIELDS):
        raise TaskYamlError(
            f"{path}: unknown field {unknown[0]!r}: the fields are {', '.join(sorted(KNOWN_FIELDS))}"
        )
    instruction = _instruction(spec, path)
    if spec.get("parser_name", "pytest") != "pytest":
        raise TaskYamlError(
            f"{path}: parser_name {spec['parser_name']!r}: only the pytest parser is converted"
        )
    _check_compose(folder / "docker-compose.yaml")
    warnings = []
    target.mkdir(parents=True)
    (target / "instruction.md").write_text(instruction, encoding="utf-8")
    (target / "task.toml").write_text(_task_toml(spec, path), encoding="utf-8")
    environment = target / "environment"
    environment.mkdir()
    for entry in folder.iterdir():
        if entry.name not in GRADER_FILES:
            _copy(entry, environment / entry.name)
    tests = target / "tests"
    if (folder / "tests").is_dir():
        shutil.copytree(folder / "tests", tests, symlinks=True)
    tests.mkdir(exist_ok=True)
    if not (folder / "run-tests.sh").is_file():
        raise TaskYamlError(f"{folder / 'run-tests.sh'}: missing (the script that runs the task's tests)")
    shutil.copy2(folder / "run-tests.sh", tests / "run-tests.sh")
    (tests / "test.sh").write_text(TEST_SH, encoding="utf-8")
    (tests / "polar_pytest_reward.py").write_text(PYTEST_REWARD, encoding="utf-8")
    if (folder / "solution.sh").is_file():
        (target / "solution").mkdir()
        shutil.copy2(folder / "solution.sh", target / "solution" / "solve.sh")
    elif (folder / "solution.yaml").is_file():
        warnings.append("solution.yaml (tmux keystrokes) is not converted: no oracle")
    return warnings


def _instruction(spec: dict[str, Any], path: Path) -> str:
    instruction = spec.get("instruction")
    if instruction is None and isinstance(spec.get("descriptions"), list):  # the oldest form: a list of keys
        base = [d for d in spec["descriptions"] if isinstance(d, dict) and d.get("key") == "base"]
        instruction = base[0].get("description") if base else None
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskYamlError(f"{path}: instruction is missing (the task's prompt)")
    return instruction


def _check_compose(path: Path) -> None:
    """Terminal-Bench 1 runs the agent in the service `client`; a task that needs another service cannot run here."""
    if not path.is_file():
        return
    try:
        compose = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise TaskYamlError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
    services = compose.get("services") if isinstance(compose, dict) else None
    if isinstance(services, dict) and (others := sorted(set(services) - {"client"})):
        raise TaskYamlError(
            f"{path}: services.{others[0]}: only the service `client` can run (sessions get no side services)"
        )


def _task_toml(spec: dict[str, Any], path: Path) -> str:
    def seconds(name: str, default: float) -> float:
        value = spec.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise TaskYamlError(f"{path}: {name} must be a positive number of seconds, not {value!r}")
        return float(value)

    metadata = {
        key: spec[key] for key in ("author_name", "author_email", "difficulty", "category") if key in spec
    }
    metadata["tags"] = [str(tag) for tag in spec.get("tags") or []]
    metadata["format"] = "terminal-bench task.yaml"
    lines = ["[metadata]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in metadata.items()]
    lines += ["", "[verifier]", f"timeout_sec = {seconds('max_test_timeout_sec', DEFAULT_TEST_TIMEOUT)}"]
    lines += ["", "[agent]", f"timeout_sec = {seconds('max_agent_timeout_sec', DEFAULT_AGENT_TIMEOUT)}", ""]
    return "\n".join(lines)


def _copy(source: Path, target: Path) -> None:
    if source.is_dir() and not source.is_symlink():
        shutil.copytree(source, target, symlinks=True)
    else:
        shutil.copy2(source, target, follow_symlinks=False)
