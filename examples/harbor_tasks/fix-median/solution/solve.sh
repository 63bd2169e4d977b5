#!/bin/bash
python3 - <<'PY'
from pathlib import Path

path = Path("/app/stats.py")
source = path.read_text()
fixed = source.replace(
    "    return ordered[middle]\n",
    "    if len(ordered) % 2:\n        return ordered[middle]\n    return (ordered[middle - 1] + ordered[middle]) / 2\n",
)
path.write_text(fixed)
PY
