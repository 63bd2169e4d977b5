#!/usr/bin/env bash
# Create (or refresh) verl's own environment at .venv-verl/ — idempotent, fast on a second run.
#
# Why a venv of its own: verl (the trainer the bridge plugs into, polar_mitm/service/verl_agent_loop.py) pins ray,
# hydra, tensordict and its own transformers, which must not decide the project's versions. torch is the CPU build
# (installed first, so verl keeps it instead of pulling 4 GB of CUDA wheels); verl's agent loop also imports
# cachetools, uvicorn and fastapi without declaring them. polar-mitm goes in without extras: the bridge needs only
# the service's client and wire models. See recipes/verl.md.
#   bash scripts/setup-verl.sh      install or check (a second run takes well under a second)
#   POLAR_VERL_VENV=DIR             another place for the venv
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${POLAR_PYTHON:-python3.11}
VENV=${POLAR_VERL_VENV:-.venv-verl}
PINS=("verl==0.9.1" "cachetools" "uvicorn" "fastapi")
STAMP=$VENV/.polar-stamp
want="$(cat scripts/setup-verl.sh pyproject.toml | sha256sum | cut -d' ' -f1)"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" && -x $VENV/bin/python ]]; then
    exit 0
fi

started=$SECONDS
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
"$VENV/bin/python" -m pip install -q "torch==2.13.0"  # the CPU build (scripts/setup.sh: pip sees it on disk)
"$VENV/bin/python" -m pip install -q "${PINS[@]}" "torch==2.13.0"
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q "typer>=0.12" "rich>=13" "orjson>=3.9"  # polar-mitm's own (the rest verl has)
# The check: verl's agent-loop registry and our bridge import here.
"$VENV/bin/python" -c 'import verl.experimental.agent_loop.agent_loop, polar_mitm.service.verl_agent_loop'
echo "$want" > "$STAMP"
echo "setup-verl.sh: ${PINS[*]} ready in $VENV ($((SECONDS - started)) s)" >&2
