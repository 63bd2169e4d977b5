"""Live updates for open pages: one background task stats the run's files (`run_files.watched`: mtimes and sizes,
no reads) every second and tells every subscriber which parts changed — `iterations`, `events`, `sessions` — as
server-sent events, so a page refetches only what it shows, without a reload.

Only one poller runs however many pages are open; it starts with the first subscriber and stops with the last.
A stream ends when the server is told to exit (`stopping`), so shutting down never waits out uvicorn's grace.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from polar_mitm.dashboard.run_files import watched

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
HEARTBEAT_SECONDS = 15.0  # a comment line, so proxies and browsers keep the stream open


class ChangeFeed:
    """Polls the run directory while anyone listens; each subscriber gets a queue of changed-part lists."""

    def __init__(self, run_dir: Path, poll_seconds: float = POLL_SECONDS) -> None:
        self.run_dir = run_dir
        self.poll_seconds = poll_seconds
        self.stopping = asyncio.Event()
        self._queues: set[asyncio.Queue[list[str]]] = set()
        self._task: asyncio.Task[None] | None = None  # kept: a task without a reference may be collected

    async def _poll(self) -> None:
        last: dict[str, Any] = await asyncio.to_thread(watched, self.run_dir)
        while self._queues and not self.stopping.is_set():
            await asyncio.sleep(self.poll_seconds)
            now = await asyncio.to_thread(watched, self.run_dir)
            changed = [part for part in now if now[part] != last.get(part)]
            last = now
            if changed:
                for queue in list(self._queues):
                    queue.put_nowait(changed)

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: `hello` first, then a `change` event (data: the changed parts) per change."""
        queue: asyncio.Queue[list[str]] = asyncio.Queue()
        self._queues.add(queue)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll())
        try:
            yield "retry: 2000\nevent: hello\ndata: {}\n\n"
            while not self.stopping.is_set():
                waiting = asyncio.ensure_future(queue.get())
                stopping = asyncio.ensure_future(self.stopping.wait())
                done, pending = await asyncio.wait(
                    {waiting, stopping}, timeout=HEARTBEAT_SECONDS, return_when=asyncio.FIRST_COMPLETED
                )
                for task in pending:
                    task.cancel()
                if waiting in done:
                    yield f"event: change\ndata: {json.dumps({'parts': waiting.result()})}\n\n"
                elif not done:
                    yield ": still here\n\n"
        finally:
            self._queues.discard(queue)
