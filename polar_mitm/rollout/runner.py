"""The staged rollout pipeline: INIT → READY buffer → RUN → POST-RUN → teardown, each stage its own worker pool.

Why stages (Polar's design): preparing a workspace (copy, clone, setup) is slow and needs no model, so INIT workers
prewarm workspaces into a bounded READY buffer while RUN workers keep the engine busy with harness sessions. The
agent timeout counts from RUN start. A timed-out or crashed harness keeps its partial records (the gateway wrote
them as they happened) and gets the configured failure reward. Straggler cut: once K sessions of a group are done,
the rest are cancelled cleanly (process group killed, workspace removed) and marked `cut`.

One session's failure never ends the rollout: an unexpected error marks that session `error` (failure reward, the
reason in `eval_output`) and the others go on. When the rollout itself is cancelled (Ctrl-C, SIGTERM), running
harnesses are stopped and `Rollout.finished()` still gives the sessions that completed, for their rewards, and
those it stopped, `cancelled` (without a reward).

How each session ended, in the one vocabulary of `storage/session_ends.py`: the runner sets its own part as it
happens (`SessionRun.end`: cut, cancelled, harness_timeout, harness_crash — a harness is graded only when it exits
0, so a non-zero exit is a crash), and `settle_ends` adds what its recorded calls say (length, context overflow, an
unparsed tool call, an engine error) once the records are written; the rewards file holds both `status` and `end`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pyarrow as pa

from polar_mitm.config_options import option, python_only
from polar_mitm.processes import children
from polar_mitm.rollout import session_sandbox
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.sandbox import DEFAULT_SANDBOX, SANDBOX_KINDS, SandboxUnavailable, SessionBox, get_sandbox
from polar_mitm.sandbox.mounts import Mount
from polar_mitm.storage.rewards import RewardRow, rewards_table, write_rewards_table
from polar_mitm.storage.session_ends import SessionEnd, read_recorded_calls, session_end
from polar_mitm.tasks.answer_check import OUTPUT_ENV as HARNESS_OUTPUT_ENV
from polar_mitm.tasks.task_file import Task

NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


# Where a session is in the pipeline (INIT → READY buffer → RUN → POST-RUN → done).
SessionStage = Literal["pending", "init", "ready", "run", "post", "done"]


@dataclass
class RolloutConfig:
    """How a rollout runs its sessions; each field is a `polar-mitm rollout` option with its help but the two the
    command sets from --work-dir (`python_only`), and `loop` takes the ones it shares from here too."""

    group_size: int = field(default=4, metadata=option("Sessions per task (G).", "--group-size", "-g"))
    concurrency: int = field(
        default=4, metadata=option("Harness sessions at once (RUN workers).", "--concurrency", "-c")
    )
    init_workers: int = field(default=2, metadata=option("INIT workers (workspace preparation)."))
    post_workers: int = field(default=2, metadata=option("POST-RUN (evaluation) workers."))
    ready_buffer: int = field(
        default=4,
        metadata=option(
            "Prewarmed workspaces waiting for a RUN worker (0 = none: RUN workers prepare inline)."
        ),
    )
    keep: int | None = field(
        default=None, metadata=option("Straggler cut: stop a group once K sessions are done.")
    )
    failure_reward: float = field(
        default=0.0, metadata=option("Reward of timed-out, crashed and failed-setup sessions.")
    )
    workspace_root: Path = field(
        default=Path("/tmp/polar-workspaces"),
        metadata=python_only("Where each session's workspace is made (`rollout`: WORK_DIR/workspaces)."),
    )
    keep_workspaces: bool = field(default=False, metadata=option("Keep workspaces after evaluation."))
    sandbox: str = field(
        default=DEFAULT_SANDBOX,
        metadata=option(
            f"Where each session (agent, then evaluation) runs: {' | '.join(SANDBOX_KINDS)} "
            "(recipes/sandboxes.md; none: unconfined on the host)."
        ),
    )
    image: str | None = field(
        default=None,
        metadata=option("The container image of --sandbox podman|docker (bash and socat in it)."),
    )
    log_dir: Path | None = field(
        default=None,
        metadata=python_only("Harness stdout/stderr per session (`rollout`: WORK_DIR/logs; None: not kept)."),
    )


@dataclass
class SessionRun:
    task: Task
    index: int
    session_id: str
    workspace: Path | None = None
    stage: SessionStage = "pending"
    status: str = ""  # ok | failed | timeout | crashed | init_failed | error | cut | cancelled
    # How it ended (session_ends.SessionEnd): the runner's part as it happens, its calls' added by `settle_ends`.
    end: str | None = None
    reward: float | None = None
    exit_code: int | None = None
    eval_output: str = ""
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None
    cut: bool = False

    def seconds(self, stage: str) -> float | None:
        span = self.spans.get(stage)
        return None if span is None else span[1] - span[0]


@dataclass
class RolloutSummary:
    sessions: list[SessionRun]
    wall_seconds: float
    run_utilisation: float  # busy RUN-worker time / (workers × span of the RUN phase)

    def table(self) -> pa.Table:
        """The rewards file's rows (storage/rewards.py), one per session."""
        return rewards_table(
            RewardRow(
                session_id=s.session_id,
                task_id=s.task.task_id,
                sample_index=s.index,
                reward=s.reward,
                status=s.status,
                end=s.end,
                exit_code=s.exit_code,
                init_seconds=s.seconds("init"),
                run_seconds=s.seconds("run"),
                eval_seconds=s.seconds("post"),
                eval_output=s.eval_output[-2000:],
            )
            for s in self.sessions
        )


async def run_shell(
    command: str, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run a shell command (task-file setup and evaluation) in its own process group; (exit code, output)."""
    return await run_argv(["bash", "-c", command], cwd, timeout, env)


async def run_argv(
    argv: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run a program with an argument vector in its own process group; (exit code, output). Raises TimeoutError.

    stdin is closed, so nothing can stop to ask for input (a git password prompt would wait for the timeout).
    """
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
        await children.stop_group(proc)
        raise
    return proc.returncode or 0, out.decode("utf-8", "replace")


def git_clone_argv(source: str) -> list[str]:
    """`git clone` of a task's `workspace.git` into the current directory, with no shell in between.

    `--` keeps a source that starts with `-` from being read as an option (`--upload-pack=…` runs a command);
    the `ext::` transport (which runs a command) is refused explicitly whatever the user's git config says.
    """
    return ["git", "-c", "protocol.ext.allow=never", "clone", "-q", "--", source, "."]


class InOrder:
    """Hands sessions on in the order they were drawn, whatever order their INIT finishes in.

    INIT workers prepare several workspaces at once; a slow setup must not let a later session overtake it into
    the READY buffer, or a group's sessions would start apart (GRPO groups, the straggler cut and `--overlap`
    assume a group runs side by side, in task order). Turns passed without a hand-off (a failed or cut INIT) do
    not hold up the ones behind them.
    """

    def __init__(self) -> None:
        self._drawn = self._next = 0
        self._passed: set[int] = set()
        self._turns: dict[int, asyncio.Event] = {}

    def draw(self) -> int:
        ticket, self._drawn = self._drawn, self._drawn + 1
        return ticket

    async def turn(self, ticket: int) -> None:
        """Wait until every earlier ticket has passed."""
        if ticket != self._next:
            await self._turns.setdefault(ticket, asyncio.Event()).wait()

    def passed(self, ticket: int) -> None:
        self._passed.add(ticket)
        while self._next in self._passed:
            self._passed.discard(self._next)
            self._turns.pop(self._next, None)
            self._next += 1
        if self._next in self._turns:
            self._turns[self._next].set()


class Rollout:
    """Runs G sessions per task through the stages; after every change `on_update` gets the live sessions and
    `on_session` the session that changed (what a scheduler with many sessions in flight wants: no walk of them all)."""

    def __init__(
        self,
        tasks: list[Task],
        harness: HarnessSpec,
        gateway: GatewayEndpoints | Sequence[GatewayEndpoints],
        config: RolloutConfig,
        on_update: Callable[[list[SessionRun]], None] | None = None,
    ) -> None:
        self.tasks, self.harness, self.config = tasks, harness, config
        # Several gateway processes (`--gateways N`): each session goes whole to the one with the fewest running
        # sessions, so its seq and token chain stay in one process.
        self.gateways = [gateway] if isinstance(gateway, GatewayEndpoints) else list(gateway)
        self.running_on = [0] * len(self.gateways)
        self.on_update = on_update or (lambda sessions: None)
        self.on_session: Callable[[SessionRun], None] = lambda s: None
        self.sandbox = get_sandbox(
            config.sandbox, config.image
        )  # unusable: SandboxUnavailable, before any session
        if not self.sandbox.confines:
            session_sandbox.warn_unconfined()
            harbor = next((t.task_id for t in tasks if t.harbor is not None), None)
            if (
                harbor is not None
            ):  # its verifier writes /logs and reads /tests: only a sandbox gives it its own
                raise SandboxUnavailable(
                    f"task {harbor!r} is a Harbor task: its verifier runs in the session's sandbox; drop --sandbox none"
                )
        self.started = time.monotonic()
        self.sessions = [
            SessionRun(task=t, index=i, session_id=f"{t.task_id}-{i}-{uuid.uuid4().hex[:8]}")
            for t in tasks
            for i in range(config.group_size)
        ]
        self.done_per_group: Counter = Counter()
        self.groups: dict[str, list[SessionRun]] = defaultdict(list)
        for s in self.sessions:
            self.groups[s.task.task_id].append(s)

    def harness_for(self, s: SessionRun) -> HarnessSpec:
        """The harness that runs `s` (one per rollout here; the streaming runner lets each session bring its own)."""
        return self.harness

    # -- stages --------------------------------------------------------------------------------------------------

    async def _init(self, s: SessionRun) -> bool:
        s.stage = "init"
        self._changed(s)
        start = time.monotonic()
        s.workspace = self.config.workspace_root / s.session_id
        try:
            if s.task.workspace_dir is not None:
                await asyncio.to_thread(shutil.copytree, s.task.workspace_dir, s.workspace, symlinks=True)
            else:
                s.workspace.mkdir(parents=True)
            if s.task.workspace_git:
                code, out = await run_argv(
                    git_clone_argv(s.task.workspace_git),
                    s.workspace,
                    s.task.timeouts.init,
                    env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
                )
                if code:
                    raise RuntimeError(f"git clone {s.task.workspace_git!r} failed ({code}): {out[-500:]}")
            for command in s.task.setup:
                code, out = await run_shell(command, s.workspace, s.task.timeouts.init)
                if code:
                    raise RuntimeError(f"setup `{command}` failed ({code}): {out[-500:]}")
        except TimeoutError:
            s.status, s.reward, s.end = "init_failed", self.config.failure_reward, SessionEnd.HARNESS_CRASH
            s.eval_output = f"INIT timed out after {s.task.timeouts.init:g}s"
            s.spans["init"] = (start, time.monotonic())
            return False
        except (OSError, RuntimeError) as exc:
            s.status, s.reward, s.eval_output = "init_failed", self.config.failure_reward, str(exc)
            s.end = SessionEnd.HARNESS_CRASH
            s.spans["init"] = (start, time.monotonic())
            return False
        s.spans["init"] = (start, time.monotonic())
        return True

    async def _run(self, s: SessionRun) -> None:
        s.stage = "run"
        self._changed(s)
        gateway = min(range(len(self.gateways)), key=self.running_on.__getitem__)
        self.running_on[gateway] += 1
        try:
            await self._run_on(s, self.gateways[gateway])
        finally:
            self.running_on[gateway] -= 1

    async def _run_on(self, s: SessionRun, gateway: GatewayEndpoints) -> None:
        launch = self.harness_for(s).launch(s.task, s.session_id, s.workspace, gateway, s.index)  # type: ignore
        box = self._box(s, launch.env, gateway)
        log = open(self.config.log_dir / f"{s.session_id}.log", "wb") if self.config.log_dir else None
        # Everything the harness starts is born in this group, `setsid` and a cleared environment included. Made
        # (and limited) off the event loop: a cgroup's mkdir and limit writes take milliseconds in the kernel.
        group = await asyncio.to_thread(session_sandbox.session_group, self.sandbox, box, s.session_id)
        start = time.monotonic()
        try:
            async with self.sandbox.session(box):
                argv, env = self.sandbox.wrap(
                    box, launch.argv, {**launch.env, children.HARNESS_RUN_ENV: s.session_id}, launch.cwd
                )
                s.proc = await asyncio.create_subprocess_exec(
                    *session_sandbox.launch_prefix(self.sandbox, box, group),
                    *argv,
                    cwd=launch.cwd,
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log or asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    s.exit_code = await asyncio.wait_for(s.proc.wait(), s.task.timeouts.run)
                    s.status = "crashed" if s.exit_code else "ok"
                    s.end = SessionEnd.HARNESS_CRASH if s.exit_code else None  # only an exit 0 is graded
                except TimeoutError:
                    await children.stop_group(s.proc)
                    s.status, s.end = "timeout", SessionEnd.HARNESS_TIMEOUT
                except asyncio.CancelledError:
                    # The rollout is interrupted: the harness must not outlive it.
                    await children.stop_group(s.proc)
                    raise
        except OSError as exc:
            s.status, s.eval_output = "crashed", f"could not start the harness: {exc}"
            s.end = SessionEnd.HARNESS_CRASH
        finally:
            if (
                group is not None
            ):  # what it left running, wherever it moved (Cline's hub daemon, `setsid` escapes)
                await asyncio.to_thread(group.stop)
            if (
                not self.sandbox.confines
            ):  # in a sandbox its PID namespace went with it; else: what kept the marker
                await asyncio.to_thread(
                    children.kill_marked, s.session_id
                )  # a /proc scan: off the event loop
            s.spans["run"] = (start, time.monotonic())
            if log:
                log.close()
        if s.cut:
            s.status, s.end = "cut", SessionEnd.CUT

    def _box(self, s: SessionRun, env: dict[str, str], gateway: GatewayEndpoints | None = None) -> SessionBox:
        return session_sandbox.session_box(self.sandbox, s.task, s.workspace, env, gateway)  # type: ignore[arg-type]

    async def _post(self, s: SessionRun) -> None:
        start = time.monotonic()
        if s.status == "ok" and s.task.harbor is not None:
            await self._grade_harbor(s)
        elif s.status == "ok":
            try:
                code, out = await self._run_eval(s)
                s.eval_output = out
                s.reward = self._reward(s.task, code, out)
                s.status = "ok" if code == 0 or s.task.eval_reward == "stdout" else "failed"
            except TimeoutError:
                s.status, s.reward, s.eval_output = (
                    "timeout",
                    self.config.failure_reward,
                    "evaluation timed out",
                )
        elif s.status != "cut":
            s.reward = self.config.failure_reward  # partial records stay; the session still gets a reward
        s.spans["post"] = (start, time.monotonic())

    async def _grade_harbor(self, s: SessionRun) -> None:
        """A Harbor task's verifier (tasks/harbor_grading.py) in the session's sandbox once the agent is gone: its
        tests placed only now at /tests, its reward read from a /logs of the session's own."""
        from polar_mitm.tasks.harbor_grading import grade

        assert s.task.harbor is not None and s.workspace is not None
        grading = self._grading_dir(s)
        shutil.rmtree(grading, ignore_errors=True)
        tests, logs = grading / "tests", grading / "logs"
        result = await grade(
            s.task.harbor,
            s.task.timeouts.eval,
            tests_dir=tests,
            logs_dir=logs,
            run=self.sandboxed_command(s, {"/tests": tests, "/logs": logs}),
            failure_reward=self.config.failure_reward,
        )
        s.reward = result.reward
        s.eval_output = f"{result.reason}\n{result.output}".strip()
        s.status = "ok" if result.accepted else "failed"

    def _grading_dir(self, s: SessionRun) -> Path:
        """Beside the workspace, never in it: what the agent could have planted there is not the verifier's."""
        return self.config.workspace_root / f"{s.session_id}.grading"

    async def _run_eval(self, s: SessionRun) -> tuple[int, str]:
        """The task's check, in the session's sandbox (the same binds, no network) once the agent is gone."""
        env = self._eval_env(s)
        if not self.sandbox.confines:
            return await run_shell(
                s.task.eval_command, s.workspace, s.task.timeouts.eval, {**os.environ, **env}
            )  # type: ignore[arg-type]
        box = self._box(s, {})
        box.readable += [Path(env[HARNESS_OUTPUT_ENV])] if HARNESS_OUTPUT_ENV in env else []
        box.readable += session_sandbox.grading_paths(s.task)
        argv, inner = self.sandbox.wrap(box, ["bash", "-c", s.task.eval_command], env, s.workspace)  # type: ignore[arg-type]
        # the agent's files may run in the check (its tests import them): the session's rlimits hold there too
        limited = [*box.limits.prlimit_argv(), *argv]
        return await run_argv(limited, s.workspace, s.task.timeouts.eval, inner)  # type: ignore[arg-type]

    def sandboxed_command(
        self, s: SessionRun, binds: dict[str, Path]
    ) -> Callable[[list[str], str, float, dict[str, str]], Awaitable[tuple[int, str]]]:
        """A grader's way into the session's sandbox after the agent (tasks/harbor_grading.py's RunCommand):
        `run(argv, cwd, timeout, env)` with `binds` (path inside → host folder, writable) over the same binds as
        the agent had, no network; `env` laid over the evaluation's."""

        async def run(argv: list[str], cwd: str, timeout: float, env: dict[str, str]) -> tuple[int, str]:
            full_env = {**self._eval_env(s), **env}
            if not self.sandbox.confines:
                return await run_argv(argv, s.workspace, timeout, {**os.environ, **full_env})  # type: ignore[arg-type]
            box = self._box(s, {})
            box.binds = [Mount(host, Path(inside), writable=True) for inside, host in binds.items()]
            wrapped, inner = self.sandbox.wrap(box, argv, full_env, box.inside if cwd is None else Path(cwd))
            limited = [*box.limits.prlimit_argv(), *wrapped]
            return await run_argv(limited, s.workspace, timeout, inner)  # type: ignore[arg-type]

        return run

    def _eval_env(self, s: SessionRun) -> dict[str, str]:
        """The evaluation's own variables (a sandbox adds nothing of the host's): the harness's output (its log),
        for checks that grade the agent's final answer rather than the workspace (`answer_check.py`)."""
        from polar_mitm.harness.base import base_environment

        env = base_environment()
        if self.config.log_dir is not None:
            env[HARNESS_OUTPUT_ENV] = str(self.config.log_dir / f"{s.session_id}.log")
        return env

    def _reward(self, task: Task, code: int, out: str) -> float:
        if task.eval_reward == "exit":
            return 1.0 if code == 0 else 0.0
        numbers = NUMBER.findall(out)
        return float(numbers[-1]) if numbers else self.config.failure_reward

    async def _fail(self, s: SessionRun, exc: Exception) -> None:
        """An unexpected error in one session: that session fails (failure reward, reason kept), the rest go on."""
        if s.proc is not None:
            await children.stop_group(s.proc)
        s.status, s.reward, s.end = "error", self.config.failure_reward, SessionEnd.HARNESS_CRASH
        s.eval_output = f"{s.stage}: {type(exc).__name__}: {exc}"
        await self._teardown(s)

    async def _guarded(self, s: SessionRun, stage: Callable[[SessionRun], Awaitable[None]]) -> None:
        """Run one session's stage; an unexpected exception fails that session instead of the whole rollout."""
        try:
            await stage(s)
        except Exception as exc:  # noqa: BLE001 — reported in the session's status and eval_output
            with contextlib.suppress(Exception):
                await self._fail(s, exc)

    async def _teardown(self, s: SessionRun) -> None:
        s.stage = "done"
        if s.status != "cut":
            self.done_per_group[s.task.task_id] += 1
            await self._maybe_cut(s.task.task_id)
        if s.workspace is not None and not self.config.keep_workspaces:
            await asyncio.to_thread(shutil.rmtree, s.workspace, True)
            await asyncio.to_thread(shutil.rmtree, self._grading_dir(s), True)
        self._changed(s)

    def _changed(self, s: SessionRun) -> None:
        self.on_update(self.sessions)
        self.on_session(s)

    def finished(self) -> RolloutSummary:
        """The sessions that completed so far (all of them after `run`) and, once the rollout was interrupted, those
        it stopped on the way (status and end `cancelled`, no reward): what an interrupted rollout can report."""
        done = [s for s in self.sessions if s.stage == "done" and s.status]
        for s in self.sessions:
            if s.stage in ("init", "ready", "run", "post") and s.status in ("", "ok", "failed"):
                s.status, s.reward, s.end = "cancelled", None, SessionEnd.CANCELLED
        stopped = [s for s in self.sessions if s.status == "cancelled"]
        return RolloutSummary(done + stopped, time.monotonic() - self.started, self._utilisation())

    def _remove_unfinished_workspaces(self) -> None:
        """After an interruption: the workspaces of sessions that never reached teardown."""
        if self.config.keep_workspaces:
            return
        for s in self.sessions:
            if s.stage != "done" and s.workspace is not None:
                shutil.rmtree(s.workspace, ignore_errors=True)

    async def _maybe_cut(self, task_id: str) -> None:
        keep = self.config.keep
        if keep is None or self.done_per_group[task_id] < keep:
            return
        for other in self.groups[task_id]:
            if other.stage != "done" and not other.cut:
                other.cut = True
                if other.proc is not None and other.stage == "run":
                    await children.stop_group(other.proc)

    # -- workers -------------------------------------------------------------------------------------------------

    def _open_stages(self) -> None:
        """Directories and the stage queues (also used by the Ray node runner, which feeds sessions one by one)."""
        cfg = self.config
        # Absolute: harnesses run with the workspace as their cwd, where a relative path would point elsewhere.
        cfg.workspace_root = cfg.workspace_root.resolve()
        cfg.workspace_root.mkdir(parents=True, exist_ok=True)
        if cfg.log_dir:
            # the check reads the harness's log by this path, in its sandbox too
            cfg.log_dir = cfg.log_dir.resolve()
            cfg.log_dir.mkdir(parents=True, exist_ok=True)
        self._buffered = cfg.ready_buffer > 0
        self._pending: asyncio.Queue[SessionRun | None] = asyncio.Queue()
        self._ready: asyncio.Queue[SessionRun | None] = asyncio.Queue(maxsize=max(cfg.ready_buffer, 0))
        self._ready_order = InOrder()
        self._post_queue: asyncio.Queue[SessionRun | None] = asyncio.Queue()

    async def run(self) -> RolloutSummary:
        """All sessions through the stages; on cancellation, running harnesses are stopped before it re-raises."""
        self._open_stages()
        for s in self.sessions:
            self._pending.put_nowait(s)
        self.started = time.monotonic()
        try:
            await self._run_pools()
        except asyncio.CancelledError:
            self._remove_unfinished_workspaces()
            raise
        return RolloutSummary(self.sessions, time.monotonic() - self.started, self._utilisation())

    async def _run_pools(self) -> None:
        """Start the worker pools and shut them down in stage order (each worker ends on a None)."""
        cfg = self.config
        posts = [asyncio.create_task(self._post_worker()) for _ in range(cfg.post_workers)]
        runs = [asyncio.create_task(self._run_worker()) for _ in range(cfg.concurrency)]
        if self._buffered:
            inits = [asyncio.create_task(self._init_worker()) for _ in range(cfg.init_workers)]
            for _ in inits:
                self._pending.put_nowait(None)
            await asyncio.gather(*inits)
            for _ in runs:
                await self._ready.put(None)
        else:
            for _ in runs:
                self._pending.put_nowait(None)
        await asyncio.gather(*runs)
        for _ in posts:
            self._post_queue.put_nowait(None)
        await asyncio.gather(*posts)

    async def _init_worker(self) -> None:
        while (s := await self._pending.get()) is not None:
            ticket = self._ready_order.draw()  # no await since the get: tickets follow the pending order
            try:
                await self._guarded(s, lambda s, ticket=ticket: self._prepare(s, ticket))
            finally:
                self._ready_order.passed(ticket)

    async def _run_worker(self) -> None:
        source = self._ready if self._buffered else self._pending
        while (s := await source.get()) is not None:
            await self._guarded(s, self._run_one)

    async def _post_worker(self) -> None:
        while (s := await self._post_queue.get()) is not None:
            await self._guarded(s, self._evaluate)

    async def _prepare(self, s: SessionRun, ticket: int) -> None:
        """INIT worker: prepare the workspace and park the session in the READY buffer, in pending order."""
        if s.cut:
            await self._finish_cut(s)
        elif await self._init(s):
            s.stage = "ready"
            self._changed(s)
            await self._ready_order.turn(ticket)
            await self._ready.put(s)  # blocks while the READY buffer is full
        else:
            await self._teardown(s)

    async def _run_one(self, s: SessionRun) -> None:
        """RUN worker: (INIT inline without a READY buffer,) run the harness, hand over to POST-RUN."""
        if s.cut:
            await self._finish_cut(s)
            return
        if not self._buffered and not await self._init(s):
            await self._teardown(s)
            return
        if s.cut:
            await self._finish_cut(s)
            return
        await self._run(s)
        # POST-RUN from here, waiting for an evaluator included: this RUN worker moves on now, and a scheduler that
        # counts sessions in RUN (the rollout service) must not hold the slot while the evaluation queue drains.
        s.stage = "post"
        self._changed(s)
        await self._post_queue.put(s)

    async def _evaluate(self, s: SessionRun) -> None:
        """POST-RUN worker: evaluate (unless cut) and tear down."""
        if s.status != "cut":
            await self._post(s)
        await self._teardown(s)

    async def _finish_cut(self, s: SessionRun) -> None:
        s.status, s.end = "cut", SessionEnd.CUT
        await self._teardown(s)

    def _utilisation(self) -> float:
        spans = [s.spans["run"] for s in self.sessions if "run" in s.spans]
        if not spans:
            return 0.0
        busy = sum(end - start for start, end in spans)
        window = max(end for _, end in spans) - min(start for start, _ in spans)
        return busy / (self.config.concurrency * window) if window > 0 else 1.0


def settle_ends(sessions: Sequence[SessionRun], records: Path | None) -> None:
    """Each session's end from the runner's part and its calls recorded under `records` (the gateway's folder;
    None: not readable here, e.g. a gateway attached elsewhere — the runner's part stays, null where it decides
    nothing)."""
    if records is None:
        return
    calls = read_recorded_calls(records)
    for s in sessions:
        s.end = session_end(s.end, calls.get(s.session_id, []))


def write_rewards(summary: RolloutSummary, path: Path, records: Path | None = None) -> None:
    """Rewards (and per-session status and end) as Parquet, or JSONL when the path ends in .jsonl; `records`: the
    folder the rollout's gateway wrote, whose calls say how each session ended (`settle_ends`)."""
    settle_ends(summary.sessions, records)
    write_rewards_table(summary.table(), path)
