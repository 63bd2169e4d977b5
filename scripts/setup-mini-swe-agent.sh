#!/usr/bin/env bash
# Create (or refresh) mini-swe-agent's own environment at .venv-mini-swe-agent/ — idempotent, fast on a second run.
#
# Why a venv of its own: mini-swe-agent runs on litellm (and pulls datasets, textual, openai 3.x), whose pins must
# not decide the project's versions; the harness is a separate program anyway, started by its `mini` console
# script (polar_mitm/harness/mini_swe_agent.py), unmodified. See recipes/mini-swe-agent.md.
#   bash scripts/setup-mini-swe-agent.sh      install or check (a second run takes well under a second)
#   POLAR_MINI_SWE_AGENT_VENV=DIR             another place for the venv
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${POLAR_PYTHON:-python3.11}
VENV=${POLAR_MINI_SWE_AGENT_VENV:-.venv-mini-swe-agent}
# litellm pinned too: mini-swe-agent asks only for >=1.75.5, and litellm changes its request shapes often.
PINS=("mini-swe-agent==2.4.6" "litellm==1.110.2")
STAMP=$VENV/.polar-stamp
want="$(sha256sum scripts/setup-mini-swe-agent.sh | cut -d' ' -f1)"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" && -x $VENV/bin/mini ]]; then
    exit 0
fi

started=$SECONDS
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
"$VENV/bin/python" -m pip install -q "${PINS[@]}"
# The check that it starts offline: the CLI answers --help without a network or a first-run setup prompt.
MSWEA_CONFIGURED=true MSWEA_SILENT_STARTUP=1 LITELLM_LOCAL_MODEL_COST_MAP=True HOME=$(mktemp -d) \
    "$VENV/bin/mini" --help > /dev/null
echo "$want" > "$STAMP"
echo "setup-mini-swe-agent.sh: ${PINS[*]} ready in $VENV ($((SECONDS - started)) s)" >&2
