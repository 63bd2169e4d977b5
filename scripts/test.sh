#!/usr/bin/env bash
# Set up the environment (idempotent), lint (ruff check + ruff format --check) and run the whole test suite. README command (2);
# CI runs this.
#   bash scripts/test.sh              everything (what .ci/run does)
#   bash scripts/test.sh --fast ...   local work: skips the tests marked `slow` (real harness CLIs, training,
#                                     the RL loop, Ray, the browser) and the browser setup; other args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [[ "${1:-}" == "--fast" ]]; then
  fast=1
  shift
fi
bash scripts/setup.sh
bash scripts/setup-sandbox.sh  # bubblewrap + socat: every rollout session runs in a bwrap sandbox (the default)
bash scripts/setup-vllm.sh  # vLLM (CPU build) in .venv-vllm for tests/vllm/test_vllm.py: a real production engine
bash scripts/setup-mini-swe-agent.sh  # harnesses with pins of their own, each in its venv (recipes/<name>.md)
bash scripts/setup-aider.sh
bash scripts/setup-hermes.sh
bash scripts/setup-openhands.sh  # on Python 3.12 (pyenv's, or POLAR_OPENHANDS_PYTHON)
bash scripts/setup-cline.sh  # npm harnesses installed per harness (.harness-cline, .harness-kilo, .harness-openclaw)
bash scripts/setup-kilo.sh
bash scripts/setup-openclaw.sh
bash scripts/setup-verl.sh  # verl (CPU) in .venv-verl: the rollout service's verl agent loop is tested against it
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .  # both modes, before the suite: pyproject's [tool.ruff] rules (ruff: the test extra)
.venv/bin/ruff format --check .  # the tree stays as `ruff format .` writes it
# Two workers (pytest-xdist; POLAR_TEST_WORKERS=0 runs in one process): one keeps only ~1.1 of 2 cores busy.
workers=(-n "${POLAR_TEST_WORKERS:-2}" --dist loadfile)  # tests/conftest.py: files sharing a server go together
if (( fast )); then
  exec .venv/bin/python -m pytest -q -ra "${workers[@]}" -m "not slow" "$@"
fi
bash scripts/setup-browser.sh  # Chromium for the report's browser test
exec .venv/bin/python -m pytest -q -ra "${workers[@]}" --durations=15 "$@"
