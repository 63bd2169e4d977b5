"""`--sandbox none`: the session runs on the host as before (its environment, files, ports); must be asked for.

Kept for machines where no sandbox can run and for debugging a harness; the runner prints a one-line warning
whenever it is chosen, because such a session can read and reach everything the rollout can.
"""

from __future__ import annotations

import os
from pathlib import Path

from polar_mitm.sandbox.base import Sandbox, SessionBox

WARNING = "warning: --sandbox none: sessions run unconfined on the host (its files, ports and processes)"


class NoSandbox(Sandbox):
    kind = "none"
    confines = False

    def wrap(
        self, box: SessionBox, argv: list[str], env: dict[str, str], cwd: Path
    ) -> tuple[list[str], dict[str, str]]:
        return argv, {**os.environ, **env}
