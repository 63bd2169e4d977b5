"""New weights back to the engine during training: `EnginePushCallback` saves the policy and pushes it
(`polar_mitm.engines.weights.push_weights`) every `push_every_steps` steps and when training ends.

The trainer does not attach it itself: whoever builds a `PolarGRPOTrainer` with `push_to_engine` set calls
`attach_engine_push(trainer)`.

The weights an engine loads are written in the narrower of the dtype they were trained in and the dtype of the
run's initial checkpoint (`write_dtype`): a bf16 model trained in fp32 is pushed as bf16 (half the bytes of a push,
and what the engine serves anyway), and `config.json` says so (`set_checkpoint_dtype`), since engines pick the dtype
they load in from it. From a loop's second training on, the training starts from the one before's fp32 copy, whose
`config.json` declares float32: so every checkpoint a training writes also records the initial checkpoint's dtype
under `SOURCE_DTYPE_KEY` (`record_source_dtype`), and `source_dtype` reads that before the declared one.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import TrainerCallback

from polar_mitm.engines.weights import push_weights
from polar_mitm.storage.run_layout import ENGINE_WEIGHTS_DIR

if TYPE_CHECKING:
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

logger = logging.getLogger(__name__)


class EnginePushCallback(TrainerCallback):
    """Push the policy to `args.push_to_engine` every `args.push_every_steps` steps and when training ends."""

    def __init__(self, trainer: PolarGRPOTrainer) -> None:
        self.trainer = trainer
        self.pushed_step = -1
        self.pushes: list[dict] = []

    def push(self) -> str | None:
        trainer = self.trainer
        step = trainer.state.global_step
        if step == self.pushed_step:
            return None
        target = Path(trainer.args.output_dir) / ENGINE_WEIGHTS_DIR
        if trainer.accelerator.is_main_process and target.exists():
            shutil.rmtree(
                target
            )  # the engine has loaded it already: the call returns once weights are in memory
        trainer.accelerator.wait_for_everyone()
        trainer.save_for_engine(target)
        version = None
        if trainer.accelerator.is_main_process:
            version = push_weights(
                trainer.args.push_to_engine, target, weight_version=trainer.policy_weight_version()
            )
            self.pushes.append({"step": step, "weight_version": version, "path": str(target)})
            logger.info(
                "pushed step %d to %s as weight_version %s", step, trainer.args.push_to_engine, version
            )
        self.pushed_step = step
        return version

    def on_step_end(self, args, state, control, **kwargs):
        every = self.trainer.args.push_every_steps
        if every and state.global_step % every == 0:
            self.push()

    def on_train_end(self, args, state, control, **kwargs):
        self.push()


def attach_engine_push(trainer: PolarGRPOTrainer) -> EnginePushCallback | None:
    """Add an `EnginePushCallback` to `trainer` when its config names an engine (`push_to_engine`); return it."""
    if not trainer.args.push_to_engine:
        return None
    callback = EnginePushCallback(trainer)
    trainer.add_callback(callback)
    return callback


SOURCE_DTYPE_KEY = "polar_source_dtype"  # config.json: the dtype of the checkpoint the run started from


def _config(directory: str | Path | None) -> dict | None:
    config = Path(directory) / "config.json" if directory is not None else None
    return json.loads(config.read_text()) if config is not None and config.exists() else None


def _dtype_named(name: object) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def checkpoint_dtype(directory: str | Path | None) -> torch.dtype | None:
    """The dtype a Hugging Face checkpoint declares in its config.json (None: no directory, or not declared)."""
    settings = _config(directory)
    if settings is None:
        return None
    return _dtype_named(settings.get("dtype") or settings.get("torch_dtype"))  # transformers 5 / 4 spelling


def source_dtype(directory: str | Path | None) -> torch.dtype | None:
    """The dtype of the run's initial checkpoint: recorded by the training that wrote `directory`, else the one
    `directory` declares (it is the initial checkpoint)."""
    settings = _config(directory)
    recorded = _dtype_named(settings.get(SOURCE_DTYPE_KEY)) if settings is not None else None
    return recorded or checkpoint_dtype(directory)


def write_dtype(trained: torch.dtype, source: str | Path | None) -> torch.dtype:
    """The dtype to write a checkpoint in: the narrower of the training dtype and the run's initial checkpoint's
    (`source_dtype` of the checkpoint the training started from)."""
    declared = source_dtype(source)
    if declared is None or not declared.is_floating_point:
        return trained
    return declared if torch.finfo(declared).bits < torch.finfo(trained).bits else trained


def record_source_dtype(directory: str | Path, source: str | Path | None) -> None:
    """Make the config.json in `directory` (when it has one) record the run's initial dtype, read from `source`,
    the checkpoint its training started from, so a training started from `directory` writes in it too."""
    config = Path(directory) / "config.json"
    dtype = source_dtype(source)
    if dtype is None or not config.exists():
        return
    settings = json.loads(config.read_text())
    settings[SOURCE_DTYPE_KEY] = str(dtype).removeprefix("torch.")
    config.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def set_checkpoint_dtype(directory: str | Path, dtype: torch.dtype) -> None:
    """Make config.json declare the dtype its weights were written in."""
    config = Path(directory) / "config.json"
    settings = json.loads(config.read_text())
    settings.pop("torch_dtype", None)
    settings["dtype"] = str(dtype).removeprefix("torch.")
    config.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
