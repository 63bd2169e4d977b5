#!/usr/bin/env bash
# Create (or refresh) the OpenHands CLI's own environment at .venv-openhands/ — idempotent, fast on a second run.
#
# Why a venv of its own, on Python 3.12: the CLI (PyPI `openhands`, on the OpenHands SDK and litellm) declares
# `Requires-Python: ==3.12.*`, and its ~200 dependencies (litellm, browser-use, fastmcp, lmnr, textual, ...) must
# not decide the project's versions. The harness is a separate program anyway, started by its `openhands` console
# script in headless mode (polar_mitm/harness/openhands.py), unmodified. See recipes/openhands.md.
#   bash scripts/setup-openhands.sh      install or check (a second run takes well under a second)
#   POLAR_OPENHANDS_VENV=DIR             another place for the venv
#   POLAR_OPENHANDS_PYTHON=PATH          the Python 3.12 to build it with (else python3.12 on PATH, else pyenv's)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${POLAR_OPENHANDS_VENV:-.venv-openhands}
# openhands pins the SDK, tools and workspace exactly; litellm and lmnr pinned too: litellm changes its request
# shapes often, and without lmnr's pin pip backtracks through a dozen lmnr/opentelemetry releases (~1 min more).
PINS=("openhands==1.16.0" "openhands-sdk==1.21.0" "openhands-tools==1.21.0" "litellm==1.110.2" "lmnr==0.8.2")
STAMP=$VENV/.polar-stamp
want="$(sha256sum scripts/setup-openhands.sh | cut -d' ' -f1)"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" && -x $VENV/bin/openhands ]]; then
    exit 0
fi

find_python() {
    if [[ -n ${POLAR_OPENHANDS_PYTHON:-} ]]; then
        echo "$POLAR_OPENHANDS_PYTHON"
    elif command -v python3.12 > /dev/null && python3.12 -c '' 2> /dev/null; then
        command -v python3.12
    else
        compgen -G '/root/.pyenv/versions/3.12.*/bin/python3.12' | sort -V | tail -1
    fi
}

started=$SECONDS
if [[ ! -x $VENV/bin/python ]]; then
    PY=$(find_python)
    if [[ -z $PY ]] || ! "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2> /dev/null; then
        echo "setup-openhands.sh: needs Python 3.12, found ${PY:-none} (set POLAR_OPENHANDS_PYTHON=/path/to/python3.12)" >&2
        exit 1
    fi
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
"$VENV/bin/python" -m pip install -q "${PINS[@]}"
# The check that it starts offline: the CLI prints its version with every proxy pointed at a dead port, no
# settings and a fresh HOME (litellm's price list from its bundled copy, not GitHub).
DEAD=http://127.0.0.1:9
HOME=$(mktemp -d) HTTPS_PROXY=$DEAD HTTP_PROXY=$DEAD https_proxy=$DEAD http_proxy=$DEAD \
    LITELLM_LOCAL_MODEL_COST_MAP=True OPENHANDS_SUPPRESS_BANNER=1 \
    "$VENV/bin/openhands" --version 2> /dev/null | grep -q "OpenHands CLI 1.16.0"
echo "$want" > "$STAMP"
echo "setup-openhands.sh: ${PINS[*]} ready in $VENV ($((SECONDS - started)) s)" >&2
