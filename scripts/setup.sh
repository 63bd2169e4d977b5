#!/usr/bin/env bash
# Create (or refresh) the one project environment at .venv/ — idempotent, fast on a second run.
#
# Why two installers: pip is the only client that sees the CPU build of torch this machine keeps on disk
# (torch==2.13.0 for Python 3.11); uv then installs everything else and applies requirements/overrides.txt,
# which lifts mitmproxy 11.0.2's declared h11<=0.14 pin so it can share one environment with the current
# openai/anthropic/google-genai SDKs (they need h11 0.16; the test suite proves the pair works).
set -euo pipefail
cd "$(dirname "$0")/.."

# The six real harness CLIs (tests/harness/test_harnesses.py), pinned in package.json + package-lock.json. Their own
# stamp lives inside node_modules/, so deleting node_modules/ reinstalls them; no npm on PATH: a warning only.
# Why the fallback: a registry mirror that lacks other platforms' optional binaries (opencode-darwin-*, …) yields
# a lock without them, which `npm ci` then calls out of sync; `npm install --no-save` installs the same locked
# versions without rewriting the lock.
NPM_STAMP=node_modules/.polar-npm-stamp
if command -v npm >/dev/null 2>&1; then
    npm_want="$(cat package.json package-lock.json | sha256sum | cut -d' ' -f1)"
    if [[ ! -f $NPM_STAMP || "$(cat "$NPM_STAMP")" != "$npm_want" ]]; then
        npm ci --no-audit --no-fund --loglevel=error 2>/dev/null \
            || npm install --no-audit --no-fund --no-save --loglevel=error
        echo "$npm_want" > "$NPM_STAMP"
    fi
else
    echo "setup.sh: npm not found; the harness CLIs (tests/harness/test_harnesses.py) are not installed" >&2
fi

PY=${POLAR_PYTHON:-python3.11}
EXTRAS=${POLAR_EXTRAS:-all}
STAMP=.venv/.polar-setup-stamp
want="$(cat pyproject.toml requirements/overrides.txt scripts/setup.sh | sha256sum | cut -d' ' -f1) $EXTRAS"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" && -x .venv/bin/polar-mitm ]]; then
    exit 0
fi

[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade "pip>=24" "uv>=0.5"
if [[ $EXTRAS == *all* || $EXTRAS == *serve* || $EXTRAS == *train* ]]; then
    .venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/uv pip install -q --python .venv/bin/python \
    --override requirements/overrides.txt -e ".[$EXTRAS]"
# Bytecode for everything installed and for the project's own modules. With PYTHONDONTWRITEBYTECODE=1, as container
# images and CI often set, Python never writes a .pyc, so every process compiled its imports from source again: each
# rollout session's SDK agent (openai + pydantic: 1.33 s of CPU to start, 0.68 s from bytecode), the engine, every
# gateway. Python reads .pyc files whatever that variable says; compileall skips what is up to date (uv's
# --compile-bytecode compiles only what that command installs).
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    polar_mitm addon >/dev/null || true
echo "$want" > "$STAMP"
