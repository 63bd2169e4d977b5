#!/bin/bash
mkdir -p /logs/verifier
# APP_ENV comes from the environment's Dockerfile (ENV), which the verifier's environment keeps.
if [ "$APP_ENV" = test ] && diff <(grep -v '^$' /app/config.env 2>/dev/null) /tests/expected.env; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
