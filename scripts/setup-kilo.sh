#!/usr/bin/env bash
# Install (or check) the Kilo Code CLI into .harness-kilo/ — idempotent, fast on a second run.
#
# Why a prefix of its own: Kilo Code's CLI (292 MB: a Bun build of its opencode fork in @kilocode/cli-linux-x64,
# so it installs offline) is one more harness on top of the six in package.json; kept apart, it neither changes
# package-lock.json nor slows `npm ci`. 7.7.7 because the registry here has no @kilocode/cli-linux-x64 for the
# newest @kilocode/cli (7.8.1): its postinstall then fails. polar_mitm/harness/kilo.py finds it. See recipes/kilo.md.
#   bash scripts/setup-kilo.sh         install or check (a second run takes well under a second)
#   POLAR_KILO_PREFIX=DIR              another place for it
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${POLAR_KILO_PREFIX:-.harness-kilo}
PIN="@kilocode/cli@7.7.7"
STAMP=$PREFIX/.polar-stamp
want="$(sha256sum scripts/setup-kilo.sh | cut -d' ' -f1)"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" && -x $PREFIX/node_modules/.bin/kilo ]]; then
    exit 0
fi

started=$SECONDS
mkdir -p "$PREFIX"
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error "$PIN"
# The check that it starts offline: the binary prints its version.
HOME=$(mktemp -d) "$PREFIX/node_modules/.bin/kilo" --version > /dev/null
echo "$want" > "$STAMP"
echo "setup-kilo.sh: $PIN ready in $PREFIX ($((SECONDS - started)) s)" >&2
