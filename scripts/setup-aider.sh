#!/usr/bin/env bash
# Create (or refresh) aider's own environment at .venv-aider/ — idempotent, fast on a second run.
#
# Why a venv of its own: aider-chat pins every dependency exactly (litellm 1.81.10, openai 2.20.0, numpy 1.26.4,
# scipy, tree-sitter, ...), which must not decide the project's versions; the harness is a separate program anyway,
# started by its `aider` console script (polar_mitm/harness/aider.py), unmodified. See recipes/aider.md.
#   bash scripts/setup-aider.sh      install or check (a second run takes well under a second)
#   POLAR_AIDER_VENV=DIR             another place for the venv
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${POLAR_PYTHON:-python3.11}
VENV=${POLAR_AIDER_VENV:-.venv-aider}
PINS=("aider-chat==0.86.2")  # its own requirements are exact pins
STAMP=$VENV/.polar-stamp
want="$(sha256sum scripts/setup-aider.sh | cut -d' ' -f1)"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" && -x $VENV/bin/aider ]]; then
    exit 0
fi

started=$SECONDS
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
"$VENV/bin/python" -m pip install -q "${PINS[@]}"
# The check that it starts offline: the CLI prints its version without a network.
LITELLM_LOCAL_MODEL_COST_MAP=True HOME=$(mktemp -d) "$VENV/bin/aider" --version > /dev/null
echo "$want" > "$STAMP"
echo "setup-aider.sh: ${PINS[*]} ready in $VENV ($((SECONDS - started)) s)" >&2
