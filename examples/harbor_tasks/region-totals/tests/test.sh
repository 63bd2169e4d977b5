#!/bin/bash
# Two graded parts in reward.json; the task's reward_rule (mean) makes one reward of them.
mkdir -p /logs/verifier
python3 /tests/check_totals.py /app/totals.csv > /logs/verifier/reward.json
