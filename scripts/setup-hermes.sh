#!/usr/bin/env bash
# Create (or refresh) Hermes Agent's own environment at .venv-hermes/ — idempotent, fast on a second run.
#
# Why a venv of its own: hermes-agent pins its dependencies exactly (openai 2.24.0, httpx 0.28.1, pydantic 2.13.4,
# rich, fastapi, uvicorn, ...), which must not decide the project's versions; the harness is a separate program
# anyway, started by its `hermes` console script (polar_mitm/harness/hermes.py), unmodified. No extras: the preset
# uses its terminal and file tools only. See recipes/hermes.md.
#   bash scripts/setup-hermes.sh      install or check (a second run takes well under a second)
#   POLAR_HERMES_VENV=DIR             another place for the venv
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${POLAR_PYTHON:-python3.11}
VENV=${POLAR_HERMES_VENV:-.venv-hermes}
PINS=("hermes-agent==0.19.0")  # its own requirements are exact pins (Requires-Python <3.14,>=3.11)
STAMP=$VENV/.polar-stamp
want="$(sha256sum scripts/setup-hermes.sh | cut -d' ' -f1)"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" && -x $VENV/bin/hermes ]]; then
    exit 0
fi

started=$SECONDS
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
"$VENV/bin/python" -m pip install -q "${PINS[@]}"
# The check that it starts offline: the CLI prints its version without a network or a first-run setup.
HERMES_HOME=$(mktemp -d) HOME=$(mktemp -d) "$VENV/bin/hermes" --version > /dev/null
echo "$want" > "$STAMP"
echo "setup-hermes.sh: ${PINS[*]} ready in $VENV ($((SECONDS - started)) s)" >&2
