"""`polar-mitm dashboard RUN_DIR`: serve the dashboard of a run directory with uvicorn until Ctrl-C.

Loopback by default. Any other address needs `POLAR_DASHBOARD_TOKEN` (the pages hold every prompt and answer of
the run): without it the command refuses in one line, exit 2, before it listens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from polar_mitm.gateway.exposure import is_loopback
from polar_mitm.storage.location import InputNotFound
from polar_mitm.user_errors import UserInputError

TOKEN_ENV = "POLAR_DASHBOARD_TOKEN"


def dashboard_token(host: str) -> str | None:
    """The token the server wants (from the environment); refuses a non-loopback host without one."""
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        raise UserInputError(
            f"--host {host} is not loopback: set {TOKEN_ENV} (every page then wants it) or bind 127.0.0.1"
        )
    return token


def dashboard_command(
    run_dir: Annotated[
        Path,
        typer.Argument(help="A loop run directory (finished or running), or a serve-rollouts --out folder."),
    ],
    host: Annotated[str, typer.Option(help="Listen address (not loopback: needs the token).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Listen port.")] = 8765,
) -> None:
    """A live web dashboard of a run: iterations, sessions and their calls' tokens, discarded rollouts, engines,
    evaluations. Read-only; updates itself while the run goes on."""
    token = dashboard_token(host)
    if not run_dir.is_dir():
        raise InputNotFound(f"{run_dir} is not a directory")
    import uvicorn

    from polar_mitm.dashboard.live import ChangeFeed
    from polar_mitm.dashboard.routes import dashboard_app

    feed = ChangeFeed(run_dir)
    server = uvicorn.Server(
        uvicorn.Config(
            dashboard_app(run_dir, token=token, feed=feed),
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=1,
        )
    )
    shown = f"[{host}]" if ":" in host else host
    print(f"dashboard of {run_dir} → http://{shown}:{port}/" + ("?token=…" if token else ""), flush=True)
    original = server.handle_exit

    def handle_exit(sig: int, frame) -> None:  # open event streams end at once, not after the grace
        feed.stopping.set()
        original(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    server.run()
