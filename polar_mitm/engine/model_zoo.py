"""Resolve a model spec (`tiny`, `smollm2` or a directory) to a local Hugging Face checkpoint, building it if needed."""

from __future__ import annotations

import os
from pathlib import Path

from polar_mitm.storage.location import InputNotFound

BUILTIN_MODELS = ("tiny", "smollm2")


def cache_root() -> Path:
    """Where built models live: $POLAR_MITM_CACHE, else ~/.cache/polar-mitm."""
    root = os.environ.get("POLAR_MITM_CACHE") or Path.home() / ".cache" / "polar-mitm"
    return Path(root)


def resolve_model(spec: str, *, seed: int = 0) -> Path:
    """Return a checkpoint directory for `spec`, building `tiny`/`smollm2` once into the cache."""
    if spec == "tiny":
        from polar_mitm.engine.tiny_model import ensure_tiny_model

        return ensure_tiny_model(cache_root() / "models" / f"tiny-qwen3-seed{seed}", seed=seed)
    if spec == "smollm2":
        from polar_mitm.engine.smollm2 import ensure_smollm2

        return ensure_smollm2(cache_root() / "models" / "smollm2-135m-instruct")
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise InputNotFound(
            f"model {spec!r}: not a checkpoint directory (no config.json) and not one of {BUILTIN_MODELS}"
        )
    return path
