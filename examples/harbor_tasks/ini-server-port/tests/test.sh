#!/bin/bash
mkdir -p /logs/verifier
if cmp -s /app/service.ini /tests/expected.ini; then
  echo 1 > /logs/verifier/reward.txt
else
  diff /tests/expected.ini /app/service.ini
  echo 0 > /logs/verifier/reward.txt
fi
