"""The child process a gateway's record writer compacts journals in (`storage/journal.py` says why).

`python -m polar_mitm.storage.compact_child OUT JOURNAL…`: compacts each journal into a shard of OUT and prints one
JSON line per journal on stdout: `{"journal", "shard"}` (shard null: no rows) or `{"journal", "error"}`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import orjson

from polar_mitm.storage.journal import compact_journal
from polar_mitm.storage.location import one_line


def main(argv: list[str]) -> int:
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
