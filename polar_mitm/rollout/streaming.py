"""The staged runner fed one session at a time, its worker pools alive until `close()`: what a Ray node runs
(ray_node.py, sessions from the driver) and what the rollout service runs (service/jobs.py, sessions of every
submitted task in one pool, each with its task's harness). The stage code is the local runner's (runner.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from polar_mitm.processes import children
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig, SessionRun


class StreamingRollout(Rollout):
    """The staged runner fed one session at a time; its worker pools live until `close()`.

    The stage code is the local runner's; only the feeding differs (sessions arrive from the driver) and the
    straggler cut, which the driver decides across nodes (`cut_group`).
    """

    def __init__(
        self,
        harness: HarnessSpec | None,
        gateway: GatewayEndpoints | Sequence[GatewayEndpoints],
        config: RolloutConfig,
    ) -> None:
        super().__init__([], harness, gateway, replace(config, keep=None))  # type: ignore[arg-type]
        self._done: dict[str, asyncio.Future[SessionRun]] = {}
        self._harnesses: dict[str, HarnessSpec] = {}  # a session's own harness (the rollout service's tasks)
        self._workers: list[asyncio.Task] = []

    def start(self) -> None:
        cfg = self.config
        self._open_stages()
        self._posts = [asyncio.create_task(self._post_worker()) for _ in range(cfg.post_workers)]
        self._runs = [asyncio.create_task(self._run_worker()) for _ in range(cfg.concurrency)]
        self._inits = (
            [asyncio.create_task(self._init_worker()) for _ in range(cfg.init_workers)]
            if self._buffered
            else []
        )
        self._workers = [*self._posts, *self._runs, *self._inits]

    async def submit(self, s: SessionRun, harness: HarnessSpec | None = None) -> SessionRun:
        """Queue a session (run by `harness`, else the runner's); returns it once it is torn down (done, failed or
        cut)."""
        if harness is not None:
            self._harnesses[s.session_id] = harness
        self.sessions.append(s)
        self.groups[s.task.task_id].append(s)
        done = asyncio.get_running_loop().create_future()
        self._done[s.session_id] = done
        self._pending.put_nowait(s)
        return await done

    async def cut_group(self, task_id: str) -> None:
        """The driver's straggler cut: the group's unfinished sessions here stop (marked `cut`)."""
        for other in self.groups[task_id]:
            if other.stage != "done" and not other.cut:
                other.cut = True
                if other.proc is not None and other.stage == "run":
                    await children.stop_group(other.proc)

    async def close(self) -> None:
        """Drain the pools in stage order (each worker ends on a None), as the local runner does at its end."""
        if self._buffered:
            for _ in self._inits:
                self._pending.put_nowait(None)
            await asyncio.gather(*self._inits)
            for _ in self._runs:
                await self._ready.put(None)
        else:
            for _ in self._runs:
                self._pending.put_nowait(None)
        await asyncio.gather(*self._runs)
        for _ in self._posts:
            self._post_queue.put_nowait(None)
        await asyncio.gather(*self._posts)

    async def abort(self) -> None:
        """Stop now: running harnesses are killed (their workers catch the cancellation), workspaces removed."""
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._remove_unfinished_workspaces()

    def harness_for(self, s: SessionRun) -> HarnessSpec:
        return self._harnesses.get(s.session_id) or super().harness_for(s)

    def _resolve(self, s: SessionRun) -> None:
        self._harnesses.pop(s.session_id, None)
        done = self._done.pop(s.session_id, None)
        if done is not None and not done.done():
            done.set_result(s)

    async def _teardown(self, s: SessionRun) -> None:
        try:
            await super()._teardown(s)
        finally:
            self._resolve(s)

    async def _fail(self, s: SessionRun, exc: Exception) -> None:
        try:
            await super()._fail(s, exc)
        finally:
            self._resolve(s)
