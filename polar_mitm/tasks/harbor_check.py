"""`polar-mitm tasks check`: before any training, each Harbor task's oracle must score 1.0 and a no-op agent 0.0.

For every task with `eval.harbor`, twice, each in a fresh copy of its workspace:

    oracle   `bash /solution/solve.sh` in the workdir (the task's solution/ shown at /solution), then the grading
    no-op    the grading alone, on the workspace as the task ships it

A task whose oracle does not reach full marks cannot be learnt from (its tests or environment are broken, or this
machine lacks what it needs); one whose no-op passes rewards doing nothing. Both are named, and the command exits 1.

Every command runs in the sandbox a rollout session of the task gets (`--sandbox`, bwrap by default; the box
rollout/session_sandbox.py makes, without a gateway): the workspace at the task's workdir, the system and the
toolchains read-only, a private /tmp and HOME, no network, the task's limits (as for a rollout's grader: rlimits,
no cgroup), and only the environment a grader is given. The oracle is the agent here, so it sees /solution and
never /tests; the verifier then gets /tests and /logs, as after a session. `--sandbox none` is refused, as a rollout
of Harbor tasks refuses it: a verifier writes /logs and reads /tests, which only a sandbox gives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

from polar_mitm.harness.base import base_environment
from polar_mitm.sandbox import Sandbox, SandboxUnavailable, SessionBox, get_sandbox
from polar_mitm.sandbox.mounts import Mount
from polar_mitm.tasks.harbor_grading import LOGS_MOUNT, TESTS_MOUNT, HarborGrade, RunCommand, grade
from polar_mitm.tasks.task_file import Task, passed

SOLUTION_MOUNT = "/solution"


def check_sandbox(kind: str, image: str | None = None) -> Sandbox:
    """The sandbox kind the checks run in, checked to run here; `none` is refused (SandboxUnavailable: one line)."""
    sandbox = get_sandbox(kind, image)
    if not sandbox.confines:
        raise SandboxUnavailable(
            "tasks check runs each oracle and verifier in a session's sandbox (a verifier writes /logs and reads "
            "/tests, which only a sandbox gives it its own): drop --sandbox none"
        )
    return sandbox


def sandboxed_run(sandbox: Sandbox, box: SessionBox, binds: dict[str, Path]) -> RunCommand:
    """A RunCommand (tasks/harbor_grading.py) that runs each command in a fresh sandbox like the session's `box`,
    with `binds` (path inside → host folder, writable) added and `env` laid over a grader's base environment, as a
    rollout runs a session's grader: its rlimits set before the sandbox starts, memory and processes included (no
    cgroup is made for it), and everything it started gone with its PID namespace."""

    async def run(argv: list[str], cwd: str, timeout: float, env: dict[str, str]) -> tuple[int, str]:
        extra = [Mount(host, Path(inside), writable=True) for inside, host in binds.items()]
        command_box = dataclasses.replace(box, binds=[*box.binds, *extra])
        async with sandbox.session(command_box):
            wrapped, host_env = sandbox.wrap(command_box, argv, {**base_environment(), **env}, Path(cwd))
            limited = [*command_box.limits.prlimit_argv(), *wrapped]
            return await _run(limited, box.workspace, timeout, host_env)

    return run


def task_box(task: Task, workspace: Path) -> SessionBox:
    """The sandbox of a session of `task` (as rollout/session_sandbox.py makes it, with no gateway: no network):
    its workspace at the task's workdir, its limits."""
    assert task.harbor is not None
    return SessionBox(workspace, workspace_inside=Path(task.harbor.workdir), limits=task.limits)


async def _run(argv: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> tuple[int, str]:
    """(exit code, output) of a command in its own process group, which is killed at the timeout."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode("utf-8", "replace")


@dataclass(frozen=True)
class CheckResult:
    """One task's oracle and no-op grades, and the verdict."""

    task_id: str
    oracle: HarborGrade | None  # None: the task has no solution/solve.sh
    noop: HarborGrade

    @property
    def problems(self) -> list[str]:
        found = []
        if self.oracle is None:
            found.append("no solution/solve.sh")
        elif not (self.oracle.accepted and passed(self.oracle.reward)):
            found.append(f"oracle scored {self.oracle.reward:g} ({self.oracle.reason})")
        if self.noop.accepted and self.noop.reward > 0:
            found.append(f"no-op scored {self.noop.reward:g}")
        return found


async def grade_attempt(sandbox: Sandbox, task: Task, root: Path, solve: bool) -> HarborGrade:
    """A fresh workspace under `root` in the task's session sandbox, the oracle run in it if `solve`, then the
    task's grading."""
    harbor = task.harbor
    assert harbor is not None
    workspace = root / "workspace"
    if task.workspace_dir is not None:
        shutil.copytree(task.workspace_dir, workspace, symlinks=True)
    else:
        workspace.mkdir(parents=True)
    box = task_box(task, workspace)
    if solve:
        assert harbor.solution is not None
        solution = root / "solution"
        shutil.copytree(harbor.solution, solution, symlinks=True)
        env = dict(task.meta.get("meta", {}).get("harbor", {}).get("solution_env") or {})
        run = sandboxed_run(sandbox, box, {SOLUTION_MOUNT: solution})
        try:
            code, output = await run(
                ["bash", f"{SOLUTION_MOUNT}/solve.sh"], harbor.workdir, task.timeouts.run, env
            )
        except TimeoutError:
            return HarborGrade(0.0, False, f"solve.sh ran past {task.timeouts.run:g} s")
        if code != 0:
            return HarborGrade(0.0, False, f"solve.sh exited {code}: {output.strip()[-200:]}", output=output)
    tests, logs = root / "tests", root / "logs"
    run = sandboxed_run(sandbox, box, {TESTS_MOUNT: tests, LOGS_MOUNT: logs})
    return await grade(harbor, task.timeouts.eval, tests_dir=tests, logs_dir=logs, run=run)


async def check_task(sandbox: Sandbox, task: Task) -> CheckResult:
    """The oracle and the no-op of one Harbor task, each in its own temporary folder."""
    with tempfile.TemporaryDirectory(prefix=f"polar-check-{task.task_id[:40]}-") as scratch:
        root = Path(scratch)
        oracle = None
        if task.harbor is not None and task.harbor.solution is not None:
            oracle = await grade_attempt(sandbox, task, root / "oracle", solve=True)
        noop = await grade_attempt(sandbox, task, root / "noop", solve=False)
    return CheckResult(task.task_id, oracle, noop)


async def check_tasks(sandbox: Sandbox, tasks: list[Task], parallel: int = 2) -> list[CheckResult]:
    """Check every Harbor task, `parallel` at a time, in the order given."""
    limit = asyncio.Semaphore(max(1, parallel))

    async def one(task: Task) -> CheckResult:
        async with limit:
            return await check_task(sandbox, task)

    return list(await asyncio.gather(*(one(task) for task in tasks)))


def _cell(result: HarborGrade | None) -> str:
    if result is None:
        return "-"
    return f"{result.reward:g}" if result.accepted else f"{result.reward:g} ({_short(result.reason)})"


def _short(text: str, limit: int = 48) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def table(results: list[CheckResult]) -> str:
    """The check's table: task, oracle, no-op, verdict."""
    rows = [("task", "oracle", "no-op", "verdict")]
    rows += [
        (
            r.task_id,
            _cell(r.oracle),
            _cell(r.noop),
            "ok" if not r.problems else "FAIL: " + "; ".join(r.problems),
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
        for row in rows
    )
