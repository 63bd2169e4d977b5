#!/usr/bin/env bash
# Debian's bubblewrap and socat: every rollout session runs in a bwrap sandbox (polar_mitm/sandbox, the default
# --sandbox bwrap) and reaches its gateway through socat inside it (recipes/sandboxes.md). Idempotent: nothing to
# do once both are on PATH.
set -euo pipefail
command -v bwrap >/dev/null 2>&1 && command -v socat >/dev/null 2>&1 && exit 0
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-sandbox.sh: bwrap/socat not found and cannot apt-get install them here (root + apt needed);" \
         "install bubblewrap and socat, or run rollouts with --sandbox none" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends bubblewrap socat >/dev/null
