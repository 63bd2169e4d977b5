"""Training as separate processes: `polar-mitm grpo` launched data-parallel (accelerate on GPUs, torchrun + gloo on
CPU), with what those processes need to push to the engine. The loop's `--train-processes` uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polar_mitm.engines import keys as engine_keys
from polar_mitm.storage.location import private_dir
from polar_mitm.storage.run_layout import TRAINING_RESULT_FILE


def train_launcher(processes: int) -> tuple[list[str], dict[str, str]]:
    """How to start `processes` data-parallel trainer processes: accelerate on GPUs, torchrun + gloo on CPU.

    (`accelerate launch --cpu --num_processes N` starts one process unless MPI is configured; torchrun with
    ACCELERATE_USE_CPU is what works on CPU — see recipes/training.md.)
    """
    import sys

    import torch

    python = Path(sys.executable)
    if torch.cuda.is_available():
        return [str(python.with_name("accelerate")), "launch", "--num_processes", str(processes), "-m"], {}
    return (
        [str(python.with_name("torchrun")), "--standalone", "--nproc_per_node", str(processes), "-m"],
        {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"},
    )


@contextlib.contextmanager
def engine_key_file(engine_url: str | None, it: Path) -> Iterator[dict[str, str]]:
    """The environment that lets trainer processes push to `engine_url`: its key in an owner-only file named by
    $POLAR_ENGINE_KEY_FILE, removed when they are done (torchrun does not pass an inherited pipe on to its workers,
    and a key in the environment would be readable in /proc)."""
    key = engine_keys.key_for(engine_url) if engine_url else None
    if key is None:
        yield {}
        return
    fd, name = tempfile.mkstemp(prefix=".engine-key-", dir=private_dir(it))  # mkstemp: mode 600
    try:
        with os.fdopen(fd, "w") as out:
            out.write(key)
        yield {engine_keys.KEY_FILE_ENV: name}
    finally:
        Path(name).unlink(missing_ok=True)


def train_in_processes(
    processes: int,
    batch_size: int,
    start: Path,
    it: Path,
    fields: dict[str, Any],
    lora_argv: list[str] | None = None,
) -> tuple[Path, str | None]:
    """One GRPO step on `it/merged` as `processes` processes running `polar-mitm grpo` with the trainer `fields` as
    its options (the same run state, so the optimizer continues as in-process), `batch_size` split across them and
    `lora_argv` (its `--lora …` options) when it trains adapters; returns (weights, version)."""
    import subprocess

    from polar_mitm.train.config_options import grpo_argv

    n = processes
    if batch_size % n:
        raise ValueError(
            f"--batch-size {batch_size} must be divisible by --train-processes {n} (the global batch stays the same)"
        )
    out = it / "train"
    launcher, env = train_launcher(n)
    per_process = {**fields, "per_device_train_batch_size": batch_size // n}
    argv = [
        *launcher,
        "polar_mitm.cli",
        "grpo",
        *("--data", str(it / "merged"), "--model", str(start), "-o", str(out), "--report-to", "none"),
        "--overwrite",  # a resumed iteration trains again into its own folder
        *grpo_argv(per_process),
    ]
    argv += lora_argv or []
    log = it / "train.log"
    with engine_key_file(fields.get("push_to_engine"), it) as key_env, open(log, "wb") as sink:
        done = subprocess.run(
            argv, env={**os.environ, **env, **key_env}, stdout=sink, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the {n}-process GRPO step failed (exit {done.returncode}); log {log}:\n{tail}")
    result = json.loads((out / TRAINING_RESULT_FILE).read_text())
    (it / "data_stats.json").write_text((out / "data_stats.json").read_text())
    saved = Path(result.get("merged") or result["model"])
    return saved, result.get("weight_version")
