#!/bin/bash
python3 - <<'PY'
import csv
from collections import defaultdict

totals = defaultdict(float)
with open("/app/sales.csv") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] += float(row["amount"])
with open("/app/totals.csv", "w", newline="") as f:
    out = csv.writer(f)
    out.writerow(["region", "total"])
    for region in sorted(totals):
        out.writerow([region, f"{totals[region]:.2f}"])
PY
