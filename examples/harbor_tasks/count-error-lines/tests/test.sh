#!/bin/bash
# The verifier: reward 1 when error_count.txt holds the number of ERROR-level lines.
mkdir -p /logs/verifier
expected=$(awk '$2 == "ERROR"' /tests/app.log | wc -l)
if [ -f /app/error_count.txt ] && [ "$(tr -d '[:space:]' < /app/error_count.txt)" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
