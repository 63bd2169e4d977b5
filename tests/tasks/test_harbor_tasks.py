"""Harbor tasks (issue 41, part 2): `polar-mitm tasks harbor` reads Harbor task folders into task lines, refusing
each bad folder in one line naming its file and field; the grading runs tests/test.sh as Harbor's verifier does and
accepts its reward only on exit 0; `polar-mitm tasks check` runs every example's oracle (1.0) and a no-op (0.0).
Commands run as a user runs them (`.venv/bin/polar-mitm`), the verifier in a session's bwrap sandbox with private
/tests and /logs."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm.sandbox import SessionBox, get_sandbox
from polar_mitm.tasks.harbor_check import sandboxed_run
from polar_mitm.tasks.harbor_grading import RewardFileError, combine, grade, read_rewards
from polar_mitm.tasks.task_file import HARBOR_UNGRADED, HarborEval, TaskLine, load_tasks, parse_task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "harbor_tasks"
POLAR = str(Path(sys.executable).with_name("polar-mitm"))


def polar(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([POLAR, *args], capture_output=True, text=True, timeout=120)


def task_folder(root: Path, name: str = "t", **files: str) -> Path:
    """A small valid Harbor task; `files` (path with '__' for '/') replaces or adds files."""
    folder = root / name
    contents = {
        "task.toml": '[task]\nname = "test/t"\n\n[verifier]\ntimeout_sec = 30.0\n',
        "instruction.md": "Write done to /app/out.txt.\n",
        "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\nCOPY seed.txt /app/\n",
        "environment/seed.txt": "seed\n",
        "tests/test.sh": "grep -qx done /app/out.txt && echo 1 > /logs/verifier/reward.txt || "
        "echo 0 > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "echo done > /app/out.txt\n",
    }
    contents.update({key.replace("__", "/"): value for key, value in files.items()})
    for path, text in contents.items():
        if text is None:
            continue
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return folder


def test_the_examples_pass_their_oracle_and_fail_their_no_op(tmp_path):
    out = tmp_path / "tasks.jsonl"
    converted = polar("tasks", "harbor", str(EXAMPLES), "-o", str(out))
    assert converted.returncode == 0, converted.stderr
    tasks = load_tasks(out)
    assert len(tasks) >= 8 and all(task.harbor is not None for task in tasks)
    checked = polar("tasks", "check", str(out))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rows = checked.stdout.splitlines()[1 : 1 + len(tasks)]
    assert all(row.split()[1:] == ["1", "0", "ok"] for row in rows), checked.stdout


@pytest.mark.parametrize(
    ("files", "where"),
    [
        ({"instruction.md": None}, "instruction.md: missing"),
        ({"task.toml": "[verifier\ntimeout_sec = 1"}, "task.toml: not TOML"),
        ({"task.toml": "[verifier]\ntimeout = 30\n"}, "task.toml: unknown field [verifier].timeout"),
        ({"task.toml": '[verifier]\ntimeout_sec = "soon"\n'}, "task.toml: [verifier].timeout_sec"),
        ({"task.toml": "[agent]\ntimeout_sec = -1\n"}, "task.toml: [agent].timeout_sec"),
        (
            {"task.toml": '[metadata]\nreward_rule = "median"\n'},
            "task.toml: [metadata].reward_rule: must be one of",
        ),
        ({"task.toml": '[environment]\nmemory = "lots"\n'}, "task.toml: [environment].memory_mb"),
        ({"tests__test.sh": None}, "tests/test.sh: missing"),
        ({"task.toml": None}, "task.toml: missing"),
        ({"environment__Dockerfile": None}, "environment/Dockerfile: missing"),
        ({"environment__Dockerfile": "FROM x\nRUN apt-get install -y jq\n"}, "Dockerfile:2: RUN"),
        ({"environment__Dockerfile": "FROM x\nWORKDIR /app\nCOPY seed.txt /etc/\n"}, "Dockerfile:3: COPY"),
        (
            {"environment__Dockerfile": "FROM x\nCOPY missing.txt /app/\n"},
            "Dockerfile:2: COPY: 'missing.txt' is not in the build context",
        ),
        (
            {"environment__docker-compose.yaml": "services:\n  main:\n    build: .\n  db:\n    image: pg\n"},
            "docker-compose.yaml: services.db",
        ),
    ],
)
def test_a_bad_folder_is_one_line_naming_its_file_and_field(tmp_path, files, where):
    folder = task_folder(tmp_path, **files)
    result = polar("tasks", "harbor", str(folder), "-o", str(tmp_path / "tasks.jsonl"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and where in lines[0] and str(folder) in lines[0], result.stderr
    assert not (tmp_path / "tasks.jsonl").exists()


def test_every_bad_folder_is_named_in_one_run(tmp_path):
    task_folder(tmp_path, "good")
    task_folder(tmp_path, "no-prompt", **{"instruction.md": None})
    task_folder(tmp_path, "no-tests", **{"tests__test.sh": None})
    result = polar("tasks", "harbor", str(tmp_path), "-o", str(tmp_path / "tasks.jsonl"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and "no-prompt/instruction.md" in lines[0] and "no-tests/tests/test.sh" in lines[1]


def test_skip_run_converts_and_warns(tmp_path):
    folder = task_folder(
        tmp_path, **{"environment__Dockerfile": "FROM x\nWORKDIR /app\nRUN apt-get update\n"}
    )
    result = polar("tasks", "harbor", str(folder), "--skip-run", "-o", str(tmp_path / "tasks.jsonl"))
    assert result.returncode == 0, result.stderr
    assert "warning: t: skipped Dockerfile:3: RUN apt-get update" in result.stderr
    line = json.loads((tmp_path / "tasks.jsonl").read_text())
    assert line["meta"]["harbor"]["skipped"] == ["Dockerfile:3: RUN apt-get update"]


def test_a_compose_main_service_gives_its_build_workdir_and_environment(tmp_path):
    compose = (
        "services:\n  main:\n    build:\n      context: ${CONTEXT_DIR}\n    working_dir: /srv\n"
        "    environment:\n      - MODE=check\n    command: sleep infinity\n"
    )
    folder = task_folder(
        tmp_path,
        **{
            "environment__docker-compose.yaml": compose,
            "environment__Dockerfile": "FROM x\nWORKDIR /srv\nENV LEVEL=2\nCOPY seed.txt data/\n",
        },
    )
    result = polar("tasks", "harbor", str(folder), "-o", str(tmp_path / "tasks.jsonl"))
    assert result.returncode == 0, result.stderr
    assert "services.main.command ignored" in result.stderr
    [task] = load_tasks(tmp_path / "tasks.jsonl")
    assert task.harbor is not None and task.harbor.workdir == "/srv"
    assert task.harbor.env == {"MODE": "check", "LEVEL": "2"}
    assert (
        task.workspace_dir is not None and (task.workspace_dir / "data" / "seed.txt").read_text() == "seed\n"
    )


def test_the_task_line_round_trips_through_the_task_file(tmp_path):
    out = tmp_path / "tasks.jsonl"
    folder = task_folder(
        tmp_path,
        **{"task.toml": '[verifier]\ntimeout_sec = 30.0\nenv = {K = "v"}\n\n[agent]\ntimeout_sec = 99\n'},
    )
    assert polar("tasks", "harbor", str(folder), "-o", str(out)).returncode == 0
    line = json.loads(out.read_text())
    assert TaskLine.model_validate(line).model_dump(exclude_none=True)["eval"] == line["eval"]
    [task] = load_tasks(out)
    assert task.prompt == (folder / "instruction.md").read_text()
    assert task.eval_command == HARBOR_UNGRADED  # a runner that does not grade Harbor tasks fails them
    assert task.timeouts.run == 99 and task.timeouts.eval == 30
    assert task.harbor == HarborEval(
        tests=tmp_path / "tasks.harbor" / "t" / "tests",
        workdir="/app",
        solution=tmp_path / "tasks.harbor" / "t" / "solution",
        env={"K": "v"},
    )
    assert (task.workspace_dir / "seed.txt").is_file() and not (task.workspace_dir / "out.txt").exists()


@pytest.mark.parametrize(
    ("harbor", "problem"),
    [
        ({"tests": "t", "command": "true"}, "unknown field 'eval.harbor.command'"),
        ({"tests": "t", "workdir": "app"}, "must be an absolute path"),
        ({"tests": "t", "reward_rule": "median"}, "must be one of only, mean, min, max, sum or key:NAME"),
        ({"tests": "missing"}, "holds no test.sh"),
    ],
)
def test_eval_harbor_is_checked_at_load(tmp_path, harbor, problem):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test.sh").write_text("true\n")
    with pytest.raises(ValueError) as raised:
        parse_task({"task_id": "x", "prompt": "p", "eval": {"harbor": harbor}}, tmp_path)
    assert problem in str(raised.value)
    with pytest.raises(ValueError, match="either command .* or harbor .*, not both"):
        parse_task(
            {"task_id": "x", "prompt": "p", "eval": {"command": "true", "harbor": {"tests": "t"}}}, tmp_path
        )


@pytest.mark.parametrize(
    ("rule", "reward"), [("mean", 0.5), ("min", 0.0), ("max", 1.0), ("sum", 1.0), ("key:values", 0.0)]
)
def test_a_reward_json_is_combined_by_the_tasks_rule(rule, reward):
    assert combine({"header": 1.0, "values": 0.0}, rule) == reward


def test_an_ambiguous_or_bad_reward_file_is_refused(tmp_path):
    with pytest.raises(RewardFileError, match="names 2 rewards .* reward_rule must say"):
        combine({"a": 1.0, "b": 0.0}, "only")
    with pytest.raises(RewardFileError, match="no 'c' among a, b"):
        combine({"a": 1.0, "b": 0.0}, "key:c")
    (tmp_path / "reward.json").write_text('{"a": true}')
    with pytest.raises(RewardFileError, match="not a finite number"):
        read_rewards(tmp_path)
    (tmp_path / "reward.txt").write_text("lots\n")
    with pytest.raises(RewardFileError, match="'lots', not a number"):
        read_rewards(tmp_path)


def grade_in_bwrap(tmp_path: Path, test_sh: str, reward_rule: str = "only"):
    """grade() as the rollout calls it, its commands in a session's bwrap sandbox with this test's own /app, /tests
    and /logs."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "test.sh").write_text(test_sh)
    workspace, tests, logs = tmp_path / "ws", tmp_path / "tests", tmp_path / "logs"
    workspace.mkdir()
    harbor = HarborEval(
        tests=tmp_path / "src", workdir="/app", reward_rule=reward_rule, env={"WHO": "verifier"}
    )
    box = SessionBox(workspace, workspace_inside=Path("/app"))
    run = sandboxed_run(get_sandbox("bwrap"), box, {"/tests": tests, "/logs": logs})
    return asyncio.run(grade(harbor, 30, tests_dir=tests, logs_dir=logs, run=run, failure_reward=-1.0))


def test_a_verifier_that_exits_non_zero_gives_the_failure_reward(tmp_path):
    result = grade_in_bwrap(tmp_path, "echo 1 > /logs/verifier/reward.txt\nexit 3\n")
    assert (result.reward, result.accepted, result.reason) == (-1.0, False, "the verifier exited 3")


def test_the_verifier_runs_in_the_workdir_with_its_env_and_reward_json(tmp_path):
    script = '[ "$PWD" = /app ] && [ "$WHO" = verifier ] && echo \'{"a": 1, "b": 0.5}\' > /logs/verifier/reward.json\n'
    result = grade_in_bwrap(tmp_path, script, reward_rule="mean")
    assert (result.reward, result.accepted, result.rewards) == (0.75, True, {"a": 1.0, "b": 0.5})


def test_a_verifier_that_writes_no_reward_gets_the_failure_reward(tmp_path):
    result = grade_in_bwrap(tmp_path, "true\n")
    assert result.reward == -1.0 and "neither reward.txt nor reward.json" in result.reason


def test_check_names_the_tasks_whose_oracle_fails_or_no_op_passes(tmp_path):
    task_folder(tmp_path / "src", "good")
    task_folder(tmp_path / "src", "broken-oracle", **{"solution__solve.sh": "echo nope > /app/out.txt\n"})
    task_folder(tmp_path / "src", "free-reward", **{"tests__test.sh": "echo 1 > /logs/verifier/reward.txt\n"})
    out = tmp_path / "tasks.jsonl"
    assert polar("tasks", "harbor", str(tmp_path / "src"), "-o", str(out)).returncode == 0
    result = polar("tasks", "check", str(out))
    assert result.returncode == 1
    assert "2 of 3 tasks fail: broken-oracle, free-reward" in result.stderr
    rows = {row.split()[0]: row for row in result.stdout.splitlines()[1:]}
    assert rows["good"].split()[1:] == ["1", "0", "ok"]
    assert "FAIL: oracle scored 0" in rows["broken-oracle"] and "FAIL: no-op scored 1" in rows["free-reward"]


def test_check_refuses_a_file_without_harbor_tasks(tmp_path):
    out = tmp_path / "tasks.jsonl"
    out.write_text(json.dumps({"task_id": "a", "prompt": "p", "eval": "true"}) + "\n")
    result = polar("tasks", "check", str(out))
    assert result.returncode == 2 and "no Harbor tasks" in result.stderr
    assert shutil.which("bwrap")


def tb1_folder(root: Path) -> Path:
    """A Terminal-Bench 1 task (task.yaml, Dockerfile at the top, run-tests.sh, solution.sh) whose tests print a
    pytest short summary, so the grading of its output runs without pytest."""
    folder = root / "tb1-task"
    (folder / "tests").mkdir(parents=True)
    (folder / "task.yaml").write_text(
        "instruction: |\n  Write done to /app/out.txt.\nauthor_name: t\ndifficulty: easy\ncategory: shell\n"
        "tags: [shell]\nparser_name: pytest\nmax_agent_timeout_sec: 120\nmax_test_timeout_sec: 30\n"
    )
    (folder / "Dockerfile").write_text(
        "FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest\nWORKDIR /app\nCOPY . .\n"
    )
    (folder / "docker-compose.yaml").write_text(
        "services:\n  client:\n    build:\n      dockerfile: Dockerfile\n"
    )
    (folder / "data.txt").write_text("data\n")
    (folder / "tests" / "test_outputs.py").write_text("def test_out(): ...\n")
    (folder / "run-tests.sh").write_text(
        '[ -f "$TEST_DIR/test_outputs.py" ] && grep -qx done /app/out.txt && s=PASSED || s=FAILED\n'
        'echo "=== short test summary info ==="\necho "$s tests/test_outputs.py::test_out"\n'
    )
    (folder / "solution.sh").write_text("echo done > /app/out.txt\n")
    return folder


def test_a_terminal_bench_1_task_yaml_folder_converts_and_checks(tmp_path):
    folder = tb1_folder(tmp_path / "src")
    out = tmp_path / "tasks.jsonl"
    result = polar("tasks", "harbor", str(folder), "-o", str(out))
    assert result.returncode == 0, result.stderr
    [task] = load_tasks(out)
    assert (
        task.prompt == "Write done to /app/out.txt.\n"
        and task.timeouts.run == 120
        and task.timeouts.eval == 30
    )
    assert sorted(p.name for p in task.workspace_dir.iterdir()) == [
        "Dockerfile",
        "data.txt",
    ]  # no grader files
    assert task.meta["meta"]["harbor"]["source"] == str(folder)
    checked = polar("tasks", "check", str(out))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[1].split()[1:] == ["1", "0", "ok"]


def test_a_bad_task_yaml_is_one_line_naming_it(tmp_path):
    folder = tb1_folder(tmp_path)
    (folder / "task.yaml").write_text("instructions: typo\n")
    result = polar("tasks", "harbor", str(folder), "-o", str(tmp_path / "tasks.jsonl"))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: {folder}/task.yaml: unknown field 'instructions': the fields are author_email, author_name, "
        "category, descriptions, difficulty, disable_asciinema, estimated_duration_sec, expert_time_estimate_min, "
        "instruction, junior_time_estimate_min, max_agent_timeout_sec, max_test_timeout_sec, parser_name, "
        "run_tests_in_same_shell, tags"
    )


def test_the_checks_sandbox_leaves_the_host_unchanged(tmp_path):
    marker = Path("/etc/polar-harbor-check-marker")
    script = f"touch {marker} 2>/dev/null && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    result = grade_in_bwrap(tmp_path, script)
    assert (result.reward, result.accepted) == (0.0, True) and not marker.exists()
    assert not Path("/app").exists() and not Path("/logs").exists()


@pytest.mark.parametrize(
    ("environment", "memory_mb"), [("", 4096), ("memory_mb = 1536", 1536), ('memory = "2G"', 2048)]
)
def test_the_memory_a_task_gives_its_container_is_its_sessions_limit(tmp_path, environment, memory_mb):
    folder = task_folder(tmp_path, **{"task.toml": f"[environment]\n{environment}\n"})
    assert polar("tasks", "harbor", str(folder), "-o", str(tmp_path / "tasks.jsonl")).returncode == 0
    [task] = load_tasks(tmp_path / "tasks.jsonl")
    assert task.limits.memory_mb == memory_mb  # unset: the sandbox's own default


def test_a_verifier_or_agent_user_is_warned_as_not_applied_and_refused_in_a_task_line(tmp_path):
    toml = '[task]\nname = "test/t"\n\n[verifier]\nuser = "root"\n\n[agent]\nuser = 1000\n'
    folder = task_folder(tmp_path, **{"task.toml": toml})
    out = tmp_path / "tasks.jsonl"
    result = polar("tasks", "harbor", str(folder), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "warning: t: task.toml [verifier].user = 'root' is not applied: every command" in result.stderr
    assert "warning: t: task.toml [agent].user = 1000 is not applied" in result.stderr
    line = json.loads(out.read_text())
    assert "user" not in line["eval"]["harbor"]
    line["eval"]["harbor"]["user"] = "root"
    out.write_text(json.dumps(line) + "\n")
    refused = polar("tasks", "check", str(out))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "eval.harbor.user" in refused.stderr and "'root' is not applied" in refused.stderr, refused.stderr
