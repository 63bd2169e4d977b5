#!/usr/bin/env bash
# Install (or check) the Cline CLI into .harness-cline/ — idempotent, fast on a second run.
#
# Why a prefix of its own: `cline` (434 MB with its platform binary, @cline/cli-linux-x64, a Bun build shipped in
# the npm package, so it installs offline) is one more harness on top of the six in package.json; kept apart, it
# neither changes package-lock.json nor slows `npm ci` for those who do not use it. polar_mitm/harness/cline.py
# finds it here. See recipes/cline.md.
#   bash scripts/setup-cline.sh         install or check (a second run takes well under a second)
#   POLAR_CLINE_PREFIX=DIR              another place for it
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${POLAR_CLINE_PREFIX:-.harness-cline}
PIN="cline@3.0.65"
STAMP=$PREFIX/.polar-stamp
want="$(sha256sum scripts/setup-cline.sh | cut -d' ' -f1)"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" && -x $PREFIX/node_modules/.bin/cline ]]; then
    exit 0
fi

started=$SECONDS
mkdir -p "$PREFIX"
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error "$PIN"
# The check that it starts offline: the binary prints its version.
HOME=$(mktemp -d) "$PREFIX/node_modules/.bin/cline" --version > /dev/null
echo "$want" > "$STAMP"
echo "setup-cline.sh: $PIN ready in $PREFIX ($((SECONDS - started)) s)" >&2
