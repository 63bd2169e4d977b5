"""`polar-mitm tasks check`: before any training, each Harbor task's oracle must score 1.0 and a no-op agent 0.0.

For every task with `eval.harbor`, twice, each in a fresh copy of its workspace:

    oracle   `bash /solution/solve.sh` in the workdir (the task's solution/ shown at /solution), then the grading
    no-op    the grading alone, on the workspace as the task ships it

A task whose oracle does not reach full marks cannot be learnt from (its tests or environment are broken, or this
machine lacks what it needs); one whose no-op passes rewards doing nothing. Both are named, and the command exits 1.

Commands run under `bwrap_run`: the host's system read-only, with the workspace at the workdir and private /tests,
/logs, /solution and /tmp writable (so no run sees another's files, and nothing on the host changes). It is one small function so
that the sandbox package's session sandbox can replace it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

from polar_mitm.tasks.harbor_grading import LOGS_MOUNT, TESTS_MOUNT, HarborGrade, RunCommand, grade
from polar_mitm.tasks.task_file import Task, passed

SOLUTION_MOUNT = "/solution"
BWRAP = "/usr/bin/bwrap"
NOT_BOUND = {"proc", "dev", "tmp"}  # given fresh inside


def bwrap_run(binds: dict[str, Path]) -> RunCommand:
    """A RunCommand that runs each command in bwrap with `binds` (sandbox path → host folder, writable) over the
    host system, read-only.

    The host's top-level folders are bound one by one (not `/` itself), so the mount points of /app, /logs… are made
    in bwrap's own root and never on the host; read-only, so a verifier that `apt-get install`s (as Terminal-Bench's
    often do) fails here instead of changing this machine.
    """

    async def run(argv: list[str], cwd: str, timeout: float, env: dict[str, str]) -> tuple[int, str]:
        command = [BWRAP, "--die-with-parent", "--unshare-pid", "--proc", "/proc", "--dev", "/dev"]
        for entry in sorted(Path("/").iterdir()):
            if entry.name in NOT_BOUND or str(entry) in binds:
                continue
            if entry.is_symlink():
                command += ["--symlink", os.readlink(entry), str(entry)]
            else:
                command += ["--ro-bind", str(entry), str(entry)]
        command += ["--tmpfs", "/tmp"]
        for target, source in binds.items():
            command += ["--bind", str(source), target]
        command += ["--chdir", cwd, "--", *argv]
        return await _run(command, timeout, {**os.environ, **env})

    return run


async def _run(argv: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str]:
    """(exit code, output) of a command in its own process group, which is killed at the timeout."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
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


async def grade_attempt(task: Task, root: Path, solve: bool) -> HarborGrade:
    """A fresh workspace under `root`, the oracle run in it if `solve`, then the task's grading."""
    harbor = task.harbor
    assert harbor is not None
    workspace = root / "workspace"
    if task.workspace_dir is not None:
        shutil.copytree(task.workspace_dir, workspace, symlinks=True)
    else:
        workspace.mkdir(parents=True)
    tests, logs = root / "tests", root / "logs"
    tests.mkdir()
    logs.mkdir()
    binds = {harbor.workdir: workspace, TESTS_MOUNT: tests, LOGS_MOUNT: logs}
    if solve:
        assert harbor.solution is not None
        solution = root / "solution"
        shutil.copytree(harbor.solution, solution, symlinks=True)
        env = dict(task.meta.get("meta", {}).get("harbor", {}).get("solution_env") or {})
        run = bwrap_run({**binds, SOLUTION_MOUNT: solution})
        try:
            code, output = await run(
                ["bash", f"{SOLUTION_MOUNT}/solve.sh"], harbor.workdir, task.timeouts.run, env
            )
        except TimeoutError:
            return HarborGrade(0.0, False, f"solve.sh ran past {task.timeouts.run:g} s")
        if code != 0:
            return HarborGrade(0.0, False, f"solve.sh exited {code}: {output.strip()[-200:]}", output=output)
    return await grade(harbor, task.timeouts.eval, tests_dir=tests, logs_dir=logs, run=bwrap_run(binds))


async def check_task(task: Task) -> CheckResult:
    """The oracle and the no-op of one Harbor task, each in its own temporary folder."""
    with tempfile.TemporaryDirectory(prefix=f"polar-check-{task.task_id[:40]}-") as scratch:
        root = Path(scratch)
        oracle = None
        if task.harbor is not None and task.harbor.solution is not None:
            oracle = await grade_attempt(task, root / "oracle", solve=True)
        noop = await grade_attempt(task, root / "noop", solve=False)
    return CheckResult(task.task_id, oracle, noop)


async def check_tasks(tasks: list[Task], parallel: int = 2) -> list[CheckResult]:
    """Check every Harbor task, `parallel` at a time, in the order given."""
    limit = asyncio.Semaphore(max(1, parallel))

    async def one(task: Task) -> CheckResult:
        async with limit:
            return await check_task(task)

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
