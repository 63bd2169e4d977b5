"""Summary tables the harness and vLLM files print at their end, shown even with `-q` and under pytest-xdist.

An xdist worker's terminal output is never shown, so a worker writes its table to the folder the controller gave
it (`workerinput["polar_tables"]`, tests/conftest.py) and the controller prints every table after the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def show_table(config: pytest.Config, title: str, lines: list[str]) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        folder = Path(workerinput["polar_tables"])
        (folder / f"{len(list(folder.iterdir())):03d}-{workerinput['workerid']}.txt").write_text(
            "\n".join([title, *lines]) + "\n"
        )
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        write_table(reporter, title, lines)


def print_worker_tables(folder: Path, reporter) -> None:
    """The controller's end of the run: every table the workers wrote, in the order they finished."""
    for path in sorted(folder.glob("*.txt")):
        title, *lines = path.read_text().splitlines()
        write_table(reporter, title, lines)


def write_table(reporter, title: str, lines: list[str]) -> None:
    reporter.write_line("\n" + title)
    for line in lines:
        reporter.write_line(line)
