"""The loop's gateways, up for the whole run.

Starting a gateway costs 2–3 s before it answers (mitmproxy's start, the engine's tokenizer loaded again), and
stopping one compacts its journal; the loop used to pay both for every rollout and evaluation. Now each rollout
points the same gateway processes at its own records folder and sampling options with one control call
(gateway/control.py), and when it ends they are pointed at `RUN/gateway-idle/` — which compacts the rollout's
journal, so its records are complete shards when the block ends, as they were when the gateway stopped.

A rollout that finds them in use (`--overlap`: a rollout ahead while another runs) starts gateways of its own for
its duration, and gateways that die or refuse a switch are replaced by fresh ones.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from polar_mitm.gateway import processes as gateway_processes

log = logging.getLogger(__name__)

IDLE_DIR = "gateway-idle"  # under RUN/: where calls between rollouts would be recorded (none are expected)


class LoopGateways:
    """N gateway processes kept across the loop's rollouts (`serving`), stopped by `close`."""

    def __init__(self, backends: list[str], run_dir: Path, *, confdir: Path) -> None:
        self.backends, self.run_dir, self.confdir = backends, run_dir, confdir
        self._gateways: list[gateway_processes.GatewayProcess] = []
        self._lock = threading.Lock()
        self.started = 0  # gateway processes started, for the figures (and the test that counts them)
        # The run's sessions' calls carry credentials under it (session_ids.py): no session writes into another.
        self.session_key = secrets.token_urlsafe(32)

    @contextmanager
    def serving(
        self, out_dir: Path, options: dict[str, str]
    ) -> Iterator[list[gateway_processes.GatewayProcess]]:
        """The gateways writing to `out_dir` (gateway K of several to `out_dir/gw-K`) with `options`; when the block
        ends, `out_dir` holds the rollout's records as shards."""
        if not self._lock.acquire(blocking=False):  # another rollout holds them: gateways of its own
            with gateway_processes.gateways_running(
                self.backends,
                out_dir,
                confdir=self.confdir,
                log=out_dir.parent / "gateway.log",
                options=options,
                session_key=self.session_key,
            ) as own:
                self.started += len(own)
                yield own
            return
        try:
            gateways = self._pointed_at(out_dir, options)
            try:
                yield gateways
            finally:
                self._point_all(self.run_dir / IDLE_DIR, {})
        finally:
            self._lock.release()

    def _pointed_at(self, out_dir: Path, options: dict[str, str]) -> list[gateway_processes.GatewayProcess]:
        if self._gateways and self._point_all(out_dir, options):
            return self._gateways
        self.close()
        self._gateways = gateway_processes.start_gateways(
            self.backends,
            out_dir,
            confdir=self.confdir,
            log=self.run_dir / "gateway.log",
            options=options,
            session_key=self.session_key,
        )
        self.started += len(self._gateways)
        return self._gateways

    def _point_all(self, out_dir: Path, options: dict[str, str]) -> bool:
        """Switch every gateway to `out_dir` (per-gateway folders for several); False (all stopped) if one fails."""
        n = len(self._gateways)
        try:
            for k, gateway in enumerate(self._gateways):
                if gateway.proc.poll() is not None:
                    raise RuntimeError(f"gateway {k} exited with {gateway.proc.returncode}")
                gateway.switch(gateway_processes.gateway_folder(out_dir, k, n), options)
            return True
        except RuntimeError as exc:
            log.warning("restarting the loop's gateways: %s", exc)
            self.close()
            return False

    def close(self) -> None:
        """Stop the gateways (each compacts its journal into its current folder)."""
        for gateway in self._gateways:
            gateway.stop()
        self._gateways = []
