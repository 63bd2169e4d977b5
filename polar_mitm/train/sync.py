"""New weights back to the engine during training: `EnginePushCallback` saves the policy and pushes it
(`polar_mitm.engines.push_weights`) every `push_every_steps` steps and when training ends.

The trainer does not attach it itself: whoever builds a `PolarGRPOTrainer` with `push_to_engine` set calls
`attach_engine_push(trainer)`.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import TrainerCallback

from polar_mitm.engines import push_weights

if TYPE_CHECKING:
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

logger = logging.getLogger(__name__)

ENGINE_WEIGHTS_DIR = "engine-weights"  # under output_dir: the checkpoint the engine was last told to load


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
