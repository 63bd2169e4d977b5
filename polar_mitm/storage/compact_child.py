"""The child process a gateway's record writer compacts journals in (`storage/journal.py` says why).

`python -m polar_mitm.storage.compact_child OUT JOURNAL…`: compacts each journal into a shard of OUT and prints one
JSON line per journal on stdout: `{"journal", "shard"}` (shard null: no rows) or `{"journal", "error"}`. It inherits
the folder's writer lock from the gateway (`journal.lock_folder`) and holds it until it ends, so no other writer
recovers the folder while this compaction still writes into it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import orjson

from polar_mitm.storage.journal import PARENT_ENV, compact_journal
from polar_mitm.storage.location import one_line


def die_with_parent() -> None:
    """SIGTERM this process when the gateway that started it dies, and end now if it already has. Set here rather
    than in a `preexec_fn`, which is not safe in a process with threads (the gateway has several)."""
    import ctypes
    import os
    import signal

    parent = int(os.environ.get(PARENT_ENV, "0"))
    if not parent:
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above: nothing compacted, its successor recovers
        sys.exit(3)


def main(argv: list[str]) -> int:
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="polar compaction: %(levelname)s %(message)s")
    out_dir, journals = Path(argv[0]), [Path(a) for a in argv[1:]]
    for journal in journals:
        try:
            shard = compact_journal(journal, out_dir)
            line = {"journal": str(journal), "shard": str(shard) if shard else None}
        except Exception as exc:  # the parent keeps the journal and retries (or finds it compacted meanwhile)
            line = {"journal": str(journal), "error": f"{type(exc).__name__}: {one_line(exc)}"}
        sys.stdout.buffer.write(orjson.dumps(line) + b"\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
