"""A file lock around building a cached checkpoint (the tiny model, SmolLM2)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def build_lock(out_dir: Path) -> Iterator[None]:
    """Hold `OUT_DIR.lock` while a checkpoint is checked and built: processes that need the same model at once (two
    loops, parallel test workers) build it once; the others wait, then find it built."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f"{out_dir.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
