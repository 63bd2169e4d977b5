"""A task's `callback_url`: each finished `SessionResult` is POSTed to it as it finishes, retried with backoff and
never holding up a session. Once the receiver has answered (any status below 500: it has the result, or refuses
it for good) the session is noted in the task's folder (`delivered.jsonl`, fsynced), so after a kill `--resume`
sends again exactly the results no receiver acknowledged — at least once, as any callback over a network can be.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx

from polar_mitm.service.models import SessionResult
from polar_mitm.storage import service_layout as layout

logger = logging.getLogger(__name__)

CALLBACK_TRIES = 5
FIRST_RETRY_S = 0.5  # then 1 s, 2 s, 4 s
_JSON = {"content-type": "application/json"}


def delivered(folder: Path) -> set[str]:
    """The session ids whose results a task's callback acknowledged."""
    return {row["session_id"] for row in layout.read_lines(folder / layout.DELIVERED_FILE)}


class Callbacks:
    """The callbacks being sent (a reference to each, so none is collected mid-flight)."""

    def __init__(self) -> None:
        self.sending: set[asyncio.Task] = set()

    def send(self, url: str, result: SessionResult, folder: Path) -> None:
        """POST `result` to `url` in the background; noted under `folder` once acknowledged."""
        task = asyncio.get_running_loop().create_task(_deliver(url, result, folder))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def close(self) -> None:
        await asyncio.gather(*self.sending, return_exceptions=True)


async def _deliver(url: str, result: SessionResult, folder: Path) -> None:
    if await _post_with_retries(url, result):
        row = {"session_id": result.session_id}
        await asyncio.to_thread(layout.append_line, folder / layout.DELIVERED_FILE, row)


async def _post_with_retries(url: str, result: SessionResult) -> bool:
    """Whether the receiver answered (below 500) within `CALLBACK_TRIES` tries; never raises."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        for attempt in range(CALLBACK_TRIES):
            try:
                response = await client.post(url, content=result.model_dump_json(), headers=_JSON)
                if response.status_code < 500:
                    return True
            except httpx.HTTPError:
                pass
            if attempt + 1 < CALLBACK_TRIES:
                await asyncio.sleep(FIRST_RETRY_S * 2**attempt)
    logger.warning(
        "callback %s: gave up on session %s after %d tries (sent again on --resume)",
        url,
        result.session_id,
        CALLBACK_TRIES,
    )
    return False
