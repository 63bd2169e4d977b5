"""How `rollout` and `loop` say what is running: a live Rich view on a terminal; elsewhere (a log file, Slurm, CI) a
line per event, or with `--log-format json` one JSON object per line for a machine to read.

A live view drawn into a file is nothing (Rich turns it off), so before this a rollout whose output was not a
terminal printed nothing until it ended. Every event has a name (`event`), the seconds since the command started
(`elapsed_s`) and its own fields; the text form is the same event as one readable line.
"""

from __future__ import annotations

import contextlib
import enum
import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO


class LogFormat(enum.StrEnum):
    auto = "auto"  # rich on a terminal, else lines
    rich = "rich"
    lines = "lines"
    json = "json"


LOG_FORMAT_HELP = "auto (a live view on a terminal, else lines) | rich | lines | json (one object per line)."


def resolved(fmt: LogFormat | str, is_terminal: bool) -> LogFormat:
    """`auto` made concrete for this output."""
    fmt = LogFormat(fmt)
    if fmt is LogFormat.auto:
        return LogFormat.rich if is_terminal else LogFormat.lines
    return fmt


@contextlib.contextmanager
def events_stdout(fmt: LogFormat) -> Iterator[TextIO]:
    """The stream events go to. With json, stdout is kept for them alone: whatever else would print there meanwhile
    (a library's banner at import: transformers prints one when WANDB_MODE=offline) goes to stderr."""
    global _EVENTS
    if fmt is not LogFormat.json:
        yield sys.stdout
        return
    kept, sys.stdout = sys.stdout, sys.stderr
    _EVENTS = kept
    try:
        yield kept
    finally:
        sys.stdout, _EVENTS = kept, None


_EVENTS: TextIO | None = None  # stdout while events_stdout keeps it for events: where an EventLog writes


class EventLog:
    """Writes events as lines or JSON objects (thread-safe, flushed: a tail -f shows each as it happens)."""

    def __init__(self, fmt: LogFormat, stream: TextIO | None = None, started: float | None = None) -> None:
        self.fmt = fmt
        self.stream = stream or _EVENTS or sys.stdout
        self.started = time.monotonic() if started is None else started
        self._lock = threading.Lock()

    def event(self, name: str, text: str, **fields: Any) -> None:
        elapsed = round(time.monotonic() - self.started, 1)
        if self.fmt is LogFormat.json:
            line = json.dumps({"event": name, "elapsed_s": elapsed, **fields}, default=str)
        else:
            line = f"[{_clock(elapsed)}] {text}"
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
