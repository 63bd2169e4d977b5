"""`polar-mitm` and `python -m polar_mitm`: the CLI (polar_mitm/cli.py), run by a preload server when
$POLAR_FORKSERVER names one (processes/forkserver.py), so a command starts without importing the CLI, torch and
the trainer again (~7 s of CPU for `loop` and `grpo`). Standard library only until then."""

from __future__ import annotations

import sys


def main() -> None:
    from polar_mitm.processes.forkserver import run_preloaded

    run_preloaded("polar_mitm.cli", sys.argv[1:])  # returns only when no server takes it
    from polar_mitm.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
