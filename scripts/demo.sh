#!/usr/bin/env bash
# Set up the environment (idempotent) and run the main job on the embedded CPU engine. README command (1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-sandbox.sh  # bubblewrap + socat: the loop runs every session in a bwrap sandbox
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/polar-mitm demo "$@"
