"""JSON-lines files that must survive a kill: a loop run's sessions and events journals (loop/run_state.py), the
rollout service's results (service/jobs.py). Each line is fsynced before `append_line` returns; a line torn by a kill
is the only thing lost, and readers leave it out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append_line(path: Path, row: dict[str, Any]) -> None:
    """One JSON line, on disk before this returns (a kill can tear only a line being written; the next line after a
    torn one starts on a line of its own, so the torn line is all that is lost)."""
    with open(path, "ab+") as sink:
        torn = sink.tell() > 0 and (sink.seek(-1, os.SEEK_END), sink.read(1))[1] != b"\n"
        sink.write((("\n" if torn else "") + json.dumps(row) + "\n").encode())
        sink.flush()
        os.fsync(sink.fileno())


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The whole JSON lines of `path` (a torn last line, from a kill mid-write, is left out)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
