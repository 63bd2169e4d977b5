"""Checks /app/stats.py's median on odd and even lists (exit 0: all right)."""

import sys

sys.path.insert(0, "/app")
from stats import mean, median  # noqa: E402

CASES = [([3, 1, 2], 2), ([4, 1, 3, 2], 2.5), ([5], 5), ([1, 2], 1.5), ([7, 7, 1, 9, 3, 2], 5.0)]
failed = [(values, want, median(values)) for values, want in CASES if median(values) != want]
for values, want, got in failed:
    print(f"median({values}) = {got}, want {want}")
assert mean([1, 2, 3]) == 2
sys.exit(1 if failed else 0)
