"""Rollout hardening (issue 18, items 4 and 13): no shell injection through ids, prompts or git URLs; INIT failures
fail the session; bad task lines are rejected at load; rewards of finished sessions are always written. Follow-up
(hardening items 4 and 11b): placeholders where bash evaluates a value whatever its quoting are refused, and so are
git transport helpers (`fd::`, `ext::`) as a workspace source."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig, write_rewards
from polar_mitm.tasks.task_file import Task, TaskFileError, load_tasks

MARKER = "PWNED"  # every injection attempt below tries to create a file whose name starts with this


def write_tasks(path: Path, tasks: list[dict]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def task(task_id: str, **extra) -> dict:
    return {"task_id": task_id, "prompt": "p", "eval": {"command": "test -f out.txt"}, **extra}


def rollout_cli(
    tasks_file: Path, harness: str, gateway, work: Path, *extra: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`polar-mitm rollout` as a user runs it, attached to the test gateway."""
    argv = [
        sys.executable,
        "-m",
        "polar_mitm",
        "rollout",
        str(tasks_file),
        "--harness",
        harness,
        "--gateway-url",
        gateway.reverse_url,
        "--gateway-proxy",
        gateway.proxy_url,
        "--work-dir",
        str(work),
        "--out",
        str(gateway.out_dir),
        "--rewards",
        str(work / "rewards.jsonl"),
        *extra,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def rewards(work: Path) -> list[dict]:
    return [json.loads(line) for line in (work / "rewards.jsonl").read_text().splitlines()]


def markers(root: Path) -> list[Path]:
    return sorted(root.rglob(f"{MARKER}*"))


# -- item 4: shell injection ---------------------------------------------------------------------------------------

SHELL_IDS = ["$(touch PWNED1)", "`touch PWNED2`", "x;touch PWNED3", "a b|touch PWNED4 &"]


def test_task_ids_with_shell_syntax_reach_the_harness_as_literal_text(gateway, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [task(task_id) for task_id in SHELL_IDS])
    harness = "cmd:printf '%s\\n' {task} {session} > out.txt"
    done = rollout_cli(tasks, harness, gateway, tmp_path / "run", "-g", "1", "--keep-workspaces")
    assert done.returncode == 0, done.stderr
    assert markers(tmp_path) == []
    rows = rewards(tmp_path / "run")
    assert sorted(r["task_id"] for r in rows) == sorted(SHELL_IDS)
    assert all(r["status"] == "ok" and r["reward"] == 1.0 for r in rows)
    for row in rows:
        workspace = tmp_path / "run" / "workspaces" / row["session_id"]
        assert (workspace / "out.txt").read_text().splitlines() == [row["task_id"], row["session_id"]]


HOSTILE_PROMPT = '$(touch PWNED1) `touch PWNED2` it\'s "quoted" \\" $HOME\ntouch PWNED3 #'


@pytest.mark.parametrize(
    "template",
    [
        'cmd:echo "{prompt}" > out.txt',
        "cmd:echo '{prompt}' > out.txt",
        "cmd:echo $'{prompt}' > out.txt",
        'cmd:echo "said: {prompt} (task {task})" > out.txt',
        'cmd:echo "$(echo {prompt})" > out.txt',
        "cmd:echo ${{NOT_SET:-{prompt}}} > out.txt",
    ],
)
def test_placeholders_inside_quotes_are_spliced_safely(gateway, tmp_path, template):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{**task("quoted"), "prompt": HOSTILE_PROMPT}])
    done = rollout_cli(tasks, template, gateway, tmp_path / "run", "-g", "1", "--keep-workspaces")
    assert done.returncode == 0, done.stderr
    assert markers(tmp_path) == []
    [row] = rewards(tmp_path / "run")
    assert row["status"] == "ok"
    written = (tmp_path / "run" / "workspaces" / row["session_id"] / "out.txt").read_text()
    assert HOSTILE_PROMPT in written


@pytest.mark.parametrize(
    ("template", "where"),
    [
        ("cmd:echo hi > out.txt # {prompt}", "comment"),
        ("cmd:echo `echo {prompt}` > out.txt", "backtick"),
        ("cmd:cat > out.txt <<EOF\n{prompt}\nEOF", "here-document"),
        ("cmd:echo \\{prompt} > out.txt", "backslash"),
        ('cmd:echo "${{NOT_SET:-{prompt}}}" > out.txt', "${...}"),
        ('cmd:echo "$(case x in x) echo {prompt};; esac)" > out.txt', "case"),
    ],
)
def test_templates_that_cannot_be_quoted_safely_are_rejected_before_any_session(
    gateway, tmp_path, template, where
):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{**task("unsafe"), "prompt": HOSTILE_PROMPT}])
    done = rollout_cli(tasks, template, gateway, tmp_path / "run", "-g", "1", "--keep-workspaces")
    assert markers(tmp_path) == []
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: --harness") and "{prompt}" in line and where in line
    assert not (tmp_path / "run" / "rewards.jsonl").exists()


def test_a_git_url_with_shell_syntax_fails_init_and_runs_nothing(gateway, tmp_path):
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README").write_text("hello\n")
    subprocess.run(["git", "-C", str(repo), "add", "README"], check=True)
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"],
        check=True,
    )
    tasks = write_tasks(
        tmp_path / "tasks.jsonl",
        [
            task("semicolon", workspace={"git": "no-such-repo; touch PWNED1"}),
            task("option", workspace={"git": "--upload-pack=touch PWNED2"}),
            task("subst", workspace={"git": f"{repo}$(touch PWNED3)"}),
            task("good", workspace={"git": str(repo)}),
        ],
    )
    done = rollout_cli(
        tasks, "cmd:echo hello > out.txt", gateway, tmp_path / "run", "-g", "1", "--keep-workspaces"
    )
    assert done.returncode == 0, done.stderr
    assert markers(tmp_path) == []
    rows = {r["task_id"]: r for r in rewards(tmp_path / "run")}
    for bad in ("semicolon", "option", "subst"):
        assert rows[bad]["status"] == "init_failed" and rows[bad]["reward"] == 0.0, rows[bad]
        assert "git clone" in rows[bad]["eval_output"]
        line = next(x for x in done.stdout.splitlines() if rows[bad]["session_id"] in x)
        assert "init_failed reward 0.000" in line and ": git clone" in line, line  # the reason, on its line
    assert rows["good"]["status"] == "ok" and rows["good"]["reward"] == 1.0
    cloned = tmp_path / "run" / "workspaces" / rows["good"]["session_id"] / "README"
    assert cloned.read_text() == "hello\n"


# -- item 13: bad task lines, rewards of finished sessions ---------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"task_id": "a\u0000b"}, "task_id"),
        ({"task_id": "esc\u001b[31m"}, "task_id"),
        ({"task_id": "two\nlines"}, "task_id"),
        ({"task_id": "del\u007f"}, "task_id"),
        ({"task_id": "\ud800"}, "task_id"),
        ({"task_id": ".."}, "task_id"),
        ({"task_id": "x" * 300}, "task_id"),
        ({"prompt": "nul\u0000prompt"}, "prompt"),
        ({"workspace": {"git": ["not", "a", "string"]}}, "workspace.git"),
        ({"workspace": {"setup": [["nested"]]}}, "workspace.setup"),
    ],
)
def test_bad_task_lines_are_rejected_at_load_with_their_line_number(tmp_path, bad, problem):
    path = write_tasks(tmp_path / "tasks.jsonl", [task("fine"), {**task("other"), **bad}])
    with pytest.raises(TaskFileError, match=rf"tasks.jsonl:2: {problem}"):
        load_tasks(path)


def test_a_nul_in_a_task_id_is_a_one_line_error_before_anything_runs(gateway, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [task("fine"), task("a\u0000b")])
    started = time.monotonic()
    done = rollout_cli(tasks, "cmd:echo hello > out.txt", gateway, tmp_path / "run", "-g", "1")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and "tasks.jsonl:2: task_id" in line and "\\x00" in line
    assert "\x00" not in done.stderr
    assert not (tmp_path / "run" / "workspaces").exists()
    assert time.monotonic() - started < 30


def test_a_session_that_fails_unexpectedly_does_not_abort_the_rollout(gateway, tmp_path):
    # Built directly (the task file would reject it): a NUL cannot be part of a path, argv or environment.
    tasks = [
        Task(task_id="a\u0000b", prompt="p", eval_command="test -f out.txt"),
        Task(task_id="fine", prompt="p", eval_command="test -f out.txt"),
    ]
    config = RolloutConfig(
        workspace_root=tmp_path / "ws",
        log_dir=tmp_path / "logs",
        group_size=2,
        concurrency=2,
        failure_reward=-1.0,
    )
    rollout = Rollout(
        tasks, HarnessSpec("cmd:echo hello > out.txt"), GatewayEndpoints(gateway.reverse_url), config
    )
    summary = asyncio.run(rollout.run())
    by_task = {s.task.task_id: s for s in summary.sessions}
    assert by_task["fine"].status == "ok" and by_task["fine"].reward == 1.0
    broken = [s for s in summary.sessions if s.task.task_id != "fine"]
    assert all(s.status == "error" and s.reward == -1.0 and "null" in s.eval_output for s in broken)
    write_rewards(summary, tmp_path / "rewards.parquet")
    table = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert sorted(r["status"] for r in table) == ["error", "error", "ok", "ok"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_rollout_writes_the_rewards_of_finished_sessions(gateway, tmp_path, sig):
    pidfile = tmp_path / "slow.pid"
    tasks = write_tasks(tmp_path / "tasks.jsonl", [task("fast"), task("slow")])
    harness = f"cmd:if [ {{task}} = slow ]; then echo $$ > {pidfile}; sleep 120; fi; echo hello > out.txt"
    work = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "polar_mitm",
        "rollout",
        str(tasks),
        "--harness",
        harness,
        "-g",
        "1",
        "--gateway-url",
        gateway.reverse_url,
        "--work-dir",
        str(work),
        "--out",
        str(gateway.out_dir),
        "--rewards",
        str(work / "rewards.jsonl"),
        # The harness writes its host pid outside its workspace, so the test can check it was stopped: unconfined.
        "--sandbox",
        "none",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    harness_pid = None
    try:
        deadline = time.monotonic() + 60
        # Interrupt once the fast session is torn down (its workspace gone) and the slow one is running.
        while time.monotonic() < deadline:
            workspaces = (
                [p.name for p in (work / "workspaces").glob("*")] if (work / "workspaces").exists() else []
            )
            if (
                pidfile.exists()
                and pidfile.read_text().strip()
                and not any(n.startswith("fast") for n in workspaces)
            ):
                break
            time.sleep(0.1)
        harness_pid = int(pidfile.read_text())
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 128 + sig, stderr
        assert "Traceback" not in stderr
        fast, slow = sorted(rewards(work), key=lambda row: row["task_id"])
        assert fast["task_id"] == "fast" and fast["status"] == "ok" and fast["reward"] == 1.0
        assert fast["end"] == "completed"
        # the session the signal stopped: a row saying so, without a reward (merge never trains on it)
        assert (slow["task_id"], slow["status"], slow["end"], slow["reward"]) == (
            "slow",
            "cancelled",
            "cancelled",
            None,
        )
        time.sleep(0.5)
        assert not Path(f"/proc/{harness_pid}").exists() or _zombie(harness_pid)  # the harness was stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if harness_pid is not None:
            try:
                os.killpg(harness_pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_the_harness_hookup_refuses_control_characters_in_ids():
    from polar_mitm.harness import HarnessError, Hookup

    for bad in (
        {"session": "s\u001b]0;owned\u0007"},
        {"session": "s", "task": "t\u0000"},
        {"session": "a\nb"},
    ):
        with pytest.raises(HarnessError, match="control"):
            Hookup("base-url", **bad)
    assert Hookup("base-url", session="$(x);`y`", task="suite/a b").identity == "suite/a b/$(x);`y`"


# -- follow-up: placeholders where bash evaluates the value; git transport helpers ---------------------------------

HOSTILE_ID = "a[$(touch PWNED)]"  # bash runs the subscript's command wherever it evaluates this as a name
EVALUATING_TEMPLATES = [
    ("echo $(( {task} ))", "$((...))"),
    ("(( {task} ))", "((...))"),
    ("[[ {task} -eq 1 ]]", "[[ ... ]]"),
    ("echo ${{a[{task}]}}", "${...}"),
    ("let x={task}", "`let`"),
    ("declare -i x={task}", "-i"),
    ("declare -i x; x={task}", "declare -i"),
    ("echo $[ {task} ]", "$[...]"),
    ("a[{task}]=1", "subscript"),
    ("read {task} < /dev/null", "`read`"),
    ("printf -v {task} x", "`printf -v`"),
    ("[ -v {task} ]", "`[ -v`"),
    ("declare {task}=1", "`declare`"),
]


@pytest.mark.parametrize(("template", "context"), EVALUATING_TEMPLATES)
def test_placeholders_that_bash_evaluates_are_refused_whatever_their_quoting(tmp_path, template, context):
    from polar_mitm.rollout.shell_template import ShellTemplate, TemplateError

    # Why: the value shell-quoted, as a placeholder outside quotes is, still runs the command in this context.
    quoted = template.format(task=shlex.quote(HOSTILE_ID))
    subprocess.run(["bash", "-c", quoted], cwd=tmp_path, capture_output=True, timeout=10)
    assert markers(tmp_path), f"bash did not evaluate {quoted!r}: not an evaluating context"
    with pytest.raises(TemplateError) as refused:
        ShellTemplate(template)
    assert "{task}" in str(refused.value) and context in str(refused.value), refused.value
    assert "bash evaluates the value" in str(refused.value)


def test_an_evaluating_template_is_refused_by_rollout_before_any_session(gateway, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [task(HOSTILE_ID)])
    done = rollout_cli(
        tasks,
        "cmd:if (( {task} )); then :; fi; echo hi > out.txt",
        gateway,
        tmp_path / "run",
        "--keep-workspaces",
    )
    assert markers(tmp_path) == []
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: --harness") and "((...))" in line


@pytest.mark.parametrize(
    "template",
    [
        "printf '%s\\n' {task}",
        "[ {task} = x ] || printf '%s\\n' {task}",
        'echo "$((1 + 2))" > /dev/null; printf "%s\\n" "{task}"',
        "(( n = 2 )); [[ $n -eq 2 ]] && printf '%s\\n' {task}",
        "export X={task}; printf '%s\\n' \"$X\"",
        "arr=(1 2); a[0]=3; printf '%s\\n' \"${{arr[1]}}\" > /dev/null; printf '%s\\n' {task}",
        "printf '%s\\n' ${{UNSET:-{task}}}",
    ],
)
def test_ordinary_templates_next_to_arithmetic_still_pass_the_value_literally(tmp_path, template):
    from polar_mitm.rollout.shell_template import ShellTemplate

    rendered = ShellTemplate(template).render({"task": HOSTILE_ID})
    done = subprocess.run(["bash", "-c", rendered], cwd=tmp_path, capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    assert done.stdout == HOSTILE_ID + "\n" and markers(tmp_path) == []


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("fd::3", "transport helper 'fd'"),
        ("ext::sh -c touch% PWNED1", "transport helper 'ext'"),
        ("::x", "transport helper ''"),
        ("hg::https://example.com/repo", "transport helper 'hg'"),
        ("foo://example.com/repo", "scheme 'foo'"),
    ],
)
def test_git_transport_helpers_are_refused_when_the_task_file_loads(tmp_path, source, problem):
    path = write_tasks(tmp_path / "tasks.jsonl", [task("fine"), task("helper", workspace={"git": source})])
    started = time.monotonic()
    with pytest.raises(TaskFileError, match=rf"tasks.jsonl:2: workspace.git .*{re.escape(problem)}"):
        load_tasks(path)
    assert time.monotonic() - started < 5
    assert markers(tmp_path) == []


def test_local_paths_and_plain_urls_still_load_and_a_local_path_clones(tmp_path):
    from polar_mitm.rollout.runner import git_clone_argv

    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README").write_text("hello\n")
    subprocess.run(["git", "-C", str(repo), "add", "README"], check=True)
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"],
        check=True,
    )
    sources = [
        str(repo),
        f"file://{repo}",
        "https://github.com/o/r.git",
        "ssh://git@host/o/r.git",
        "git://host/o/r.git",
        "git@github.com:o/r.git",
        "relative/dir",
    ]
    path = write_tasks(
        tmp_path / "tasks.jsonl", [task(f"t{k}", workspace={"git": s}) for k, s in enumerate(sources)]
    )
    assert [t.workspace_git for t in load_tasks(path)] == sources
    for k, source in enumerate(sources[:2]):
        clone = tmp_path / f"clone{k}"
        clone.mkdir()
        subprocess.run(git_clone_argv(source), cwd=clone, check=True, capture_output=True, timeout=60)
        assert (clone / "README").read_text() == "hello\n"


def test_a_rollout_into_a_log_says_each_finished_session_as_a_line(gateway, tmp_path):
    """Not a terminal (a log file, Slurm): `auto` is a line per finished session (the live view drew nothing, so
    nothing was said until the end)."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", [task("writes"), task("idle")])
    harness = "cmd:if [ {task} = writes ]; then echo hello > out.txt; fi"
    done = rollout_cli(tasks, harness, gateway, tmp_path / "run", "-g", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert re.fullmatch(r"\[0:00:\d\d\] rollout: 4 sessions", lines[0]), lines[0]
    finished = [line for line in lines if re.match(r"\[\d:\d\d:\d\d\] \d/4 ", line)]
    assert [line.split("] ")[1].split()[0] for line in finished] == ["1/4", "2/4", "3/4", "4/4"]
    outcomes = sorted(" ".join(line.split()[3:6]) for line in finished)
    assert outcomes == ["failed reward 0.000"] * 2 + ["ok reward 1.000"] * 2, finished
    assert "rewards by task" in done.stdout  # the closing table as before


def test_log_format_json_is_one_object_per_line_and_nothing_else(gateway, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [task("writes")])
    harness = "cmd:echo hello > out.txt"
    done = rollout_cli(tasks, harness, gateway, tmp_path / "run", "-g", "3", "--log-format", "json")
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]  # every line is JSON
    assert [e["event"] for e in events] == ["rollout", "session", "session", "session", "finished"]
    sessions = [e for e in events if e["event"] == "session"]
    assert {(e["task_id"], e["status"], e["reward"]) for e in sessions} == {("writes", "ok", 1.0)}
    assert [e["done"] for e in sessions] == [1, 2, 3] and all(e["seconds"] >= 0 for e in sessions)
    closing = events[-1]
    assert closing["sessions"] == 3 and closing["tasks"][0]["reward_mean"] == 1.0
    assert closing["rewards"] == str(tmp_path / "run" / "rewards.jsonl")
