"""Grades totals.csv: `header` (the exact header line) and `values` (every region's total, in order)."""

import csv
import json
import sys
from pathlib import Path

EXPECTED = [("east", "145.45"), ("north", "23.60"), ("south", "8.00"), ("west", "19.99")]
path = Path(sys.argv[1])
rows = list(csv.reader(path.open())) if path.is_file() else []
header = 1.0 if rows and rows[0] == ["region", "total"] else 0.0
values = 1.0 if [tuple(row) for row in rows[1:]] == EXPECTED else 0.0
print(json.dumps({"header": header, "values": values}))
