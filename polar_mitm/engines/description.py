"""The gateway's side of `<polar_out>/_engine.json` (the file itself is `storage/engine_info.py`'s): once the engine
answers `GET /model_info` — and, in tokens mode, once the gateway's renderer has found the chat template's
end-of-turn token — describe the engine next to the records, so `polar-mitm merge flows/` needs no
`--eot-token`/`--tokenizer` for records this gateway wrote.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from polar_mitm.storage.engine_info import engine_description, write_engine_file

log = logging.getLogger(__name__)


async def record_engine(
    out_dir: Path,
    backend: str,
    model_info: Callable[[], Awaitable[dict[str, Any]]],
    warm_renderer: Callable[[], Awaitable[Any]] | None = None,
    *,
    retry_seconds: float = 2.0,
) -> None:
    """Wait for the engine's /model_info (it may start after the gateway), then write the sidecar.

    `warm_renderer` (tokens mode) loads the engine's tokenizer now rather than on the first call; once it is loaded
    the sidecar is written again with its end-of-turn token. Runs until written (cancel it to stop).
    """
    while True:
        try:
            info = await model_info()
            break
        except Exception as exc:  # the engine is not up yet: try again, the gateway serves meanwhile
            log.debug("engine /model_info not available yet: %s", exc)
            await asyncio.sleep(retry_seconds)
    path = await asyncio.to_thread(write_engine_file, out_dir, engine_description(info, backend))
    renderer = await warm_renderer() if warm_renderer is not None else None
    if getattr(renderer, "eot_id", None) is not None:
        description = engine_description(
            info, backend, eot_token_id=renderer.eot_id, eot_text=renderer.eot_text
        )
        path = await asyncio.to_thread(write_engine_file, out_dir, description)
    log.info("engine recorded in %s", path)
