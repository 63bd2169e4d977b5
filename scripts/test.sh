#!/usr/bin/env bash
# Set up the environment (idempotent) and run the whole test suite. README command (2); CI runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-browser.sh  # Chromium for the report's browser test
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -ra "$@"
