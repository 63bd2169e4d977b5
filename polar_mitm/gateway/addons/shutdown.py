"""SIGTERM: the calls in flight end as records (run on for the grace period, then aborted), then the journal closes.

The journal is the one thing a shutdown must not lose: every call that started is in it, `abort` if it was cut.
"""

from __future__ import annotations

import logging

from polar_mitm.gateway.addons.core import GatewayCore
from polar_mitm.gateway.cancel import SHUTDOWN
from polar_mitm.gateway.live import ABORT_DRAIN_SECONDS

log = logging.getLogger(__name__)


class Shutdown:
    """Waits for the calls in flight, aborts those still running after the grace period, closes what is open."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def done(self) -> None:
        """Calls in flight run on for the grace period, then are aborted and recorded; then exit."""
        core = self.core
        core.closing = True
        if core.engine_task is not None:
            core.engine_task.cancel()
        grace = core.options.shutdown_grace_seconds if core.options is not None else 0.0
        await core.wait_calls(grace)
        if core.calls_running:
            log.warning(
                "shutting down: aborting %d call(s) still running after %.0f s of grace",
                core.calls_running,
                grace,
            )
            core.calls.cancel_all(SHUTDOWN)
            core.hop.stop_all(SHUTDOWN)
            await core.wait_calls(ABORT_DRAIN_SECONDS + 2)
        if core.writer is not None:
            core.writer.close()
        if core.engine is not None:
            await core.engine.aclose()
        await core.hop.close()
