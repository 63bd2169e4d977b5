"""How one loop iteration's GRPO training runs: skipped when every group is flat, found on disk when a kill came
after it saved everything, or run — in this process or as `--train-processes` processes (train/launch.py).

Every iteration continues the run's one optimizer (`RUN/trainer-state`, train/continuation.py): the AdamW state, the
LR schedule spanning all iterations and the step count of the training before, and the KL reference stays the run's
initial model. The trainer's fields are `--grpo` over the loop's defaults, then what the loop sets (LOOP_SETS), the
same for either way of running. The loop's stage markers and the push of the weights stay the loop's (loop.py).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_mitm.loop.config import LOOP_TRAINER_DEFAULTS, LoopConfig
from polar_mitm.loop.progress import LoopProgress, trainer_progress_callback
from polar_mitm.loop.run_state import append_event, in_run_dir, stored_path, write_json_atomic
from polar_mitm.loop.stages import TrainedModel
from polar_mitm.loop.trackers import Tracker, log_training_metrics
from polar_mitm.storage.run_layout import (
    ENGINE_WEIGHTS_DIR,
    RUN_STATE_DIR,
    SKIPPED_TRAINING_FILE,
    iteration_dir,
)
from polar_mitm.train.launch import train_in_processes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IterationTraining:
    """Iteration `iteration`'s training from the weights the loop has now (`model_dir`, numbered `weight_version`).

    `trainer_callbacks`: extra transformers `TrainerCallback`s for a training in this process (beside the loop's
    progress line)."""

    cfg: LoopConfig
    iteration: int
    initial_model_dir: Path  # the run's starting model: LoRA's base, the KL reference
    model_dir: Path  # the newest weights: where a full-weights training starts
    weight_version: str
    engine_url: str | None  # the engine the trainer pushes to (None: a training driven alone)
    tracker: Tracker
    progress: LoopProgress
    trainer_callbacks: list
    recorded_run_dir: Path  # where the run was started (paths its markers hold are read under cfg.run_dir)

    @property
    def it(self) -> Path:
        return iteration_dir(self.cfg.run_dir, self.iteration)

    @property
    def run_state_dir(self) -> Path:
        return self.cfg.run_dir / RUN_STATE_DIR

    def run(self) -> TrainedModel:
        """The training: skipped (flat groups), found on disk (a kill after it saved all), or run now."""
        return self.skipped() or self.found_on_disk() or self.train()

    def fields(self) -> dict[str, Any]:
        """The PolarGRPOConfig fields of this training: `cfg.grpo` over the loop's defaults, then what the loop sets
        (LOOP_SETS) — the same for a training in this process or in `--train-processes` ones."""
        cfg = self.cfg
        fields = {**LOOP_TRAINER_DEFAULTS, **cfg.grpo}
        reference = fields.get("reference_model")
        fields.update(
            learning_rate=cfg.learning_rate,
            per_device_train_batch_size=cfg.per_device_batch_size,
            num_train_epochs=cfg.epochs,
            temperature=cfg.temperature,
            seed=cfg.seed,
            push_to_engine=self.engine_url,
            # The weights we start from, not "the newest in the data": with --overlap the data is one version behind,
            # and staleness (hence the importance correction) is measured against this.
            policy_weight_version=self.weight_version,
            run_state_dir=str(self.run_state_dir),
            lr_schedule_trainings=cfg.iterations,
            save_merged=True,
            # The initial policy unless asked otherwise (`start`: each iteration's own starting weights).
            reference_model=str(self.initial_model_dir) if reference is None else reference,
        )
        fields.pop("resume_from_checkpoint", None)
        return fields

    def start_dir(self) -> Path:
        """LoRA trains adapters on the initial model (the adapter so far comes from RUN/trainer-state); full
        weights continue from the newest checkpoint."""
        return self.initial_model_dir if self.cfg.lora else self.model_dir

    def skipped(self) -> TrainedModel | None:
        """No training when every group of the iteration is flat (one reward per group): there is no policy
        gradient, yet AdamW's momentum and weight decay would still move the weights (issue 29's capstone run: the
        flat iterations were half its training time, and its KL rose on them). The weights, the optimizer and the
        LR schedule stay; the training still counts (RunState), and `RUN/iter-K/train/skipped.json` says why.
        --grpo keep_zero_advantage_groups=true trains on flat groups anyway."""
        from polar_mitm.train.continuation import RunState, count_skipped_training, recover_run_state

        started, k = time.monotonic(), self.iteration
        marker = self.it / "train" / SKIPPED_TRAINING_FILE
        if not marker.exists() and not self._write_skipped_marker(marker):
            return None
        skipped = json.loads(marker.read_text())
        recover_run_state(self.run_state_dir)
        if (
            RunState.load(self.run_state_dir).trainings == k
        ):  # not counted yet (a kill may have come in between)
            count_skipped_training(self.run_state_dir)
        append_event(self.cfg.run_dir, "train_skipped", k, "train", sequences=skipped["sequences"])
        logger.warning(
            "iteration %d: every group is flat (equal rewards): no optimizer step, the weights stay", k
        )
        return TrainedModel(
            in_run_dir(skipped["model_dir"], self.cfg.run_dir, self.recorded_run_dir),
            skipped["weight_version"],
            time.monotonic() - started,
            skipped=True,
        )

    def _write_skipped_marker(self, marker: Path) -> bool:
        """Whether every group of the iteration's merged data is flat; if so, `marker` says so (and which weights
        stay)."""
        from polar_mitm.train.data import load_sequences
        from polar_mitm.train.run import training_data

        fields = self.fields()
        if fields.get("keep_zero_advantage_groups"):
            return False
        rows = [
            r
            for r in training_data(load_sequences([self.it / "merged"]), fields).rows
            if not r.get("placeholder")
        ]
        if not rows or any(float(r["advantage"]) != 0.0 for r in rows):
            return False
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            marker,
            {
                "reason": "every group is flat",
                "sequences": len(rows),
                "model_dir": stored_path(self.model_dir, self.cfg.run_dir),
                "weight_version": self.weight_version,
            },
        )
        return True

    def found_on_disk(self) -> TrainedModel | None:
        """The training when a kill came after it saved everything (the optimizer state counts it); None when it
        must run, with what an interrupted one left removed."""
        from polar_mitm.train.continuation import RunState, recover_run_state

        k, it, directory = self.iteration, self.it, self.run_state_dir
        recover_run_state(directory)
        run_state = RunState.load(directory)
        if run_state.trainings == k + 1:
            log_training_metrics(self.tracker, it / "train" / "metrics.jsonl")
            trained = it / "train" / "merged" if self.cfg.lora else it / "train"
            return TrainedModel(trained, run_state.policy_weight_version, 0.0)
        if run_state.trainings != k:
            raise RuntimeError(
                f"{directory} holds {run_state.trainings} trainings; iteration {k} must follow {k} of them"
            )
        shutil.rmtree(it / "train", ignore_errors=True)  # a training the kill interrupted starts over
        return None

    def train(self) -> TrainedModel:
        """The training itself, as `--train-processes` processes or in this process."""
        started = time.monotonic()
        self.progress.stage(self.iteration, "train")
        fields = self.fields()
        if self.cfg.train_processes > 1:
            model_dir, version = self._in_processes(fields)
        else:
            model_dir, version = self._in_this_process(fields)
        return TrainedModel(model_dir, version, time.monotonic() - started)

    def _in_processes(self, fields: dict[str, Any]) -> tuple[Path, str | None]:
        """`--train-processes N`: one distributed run of N processes (train/launch.py); the saved weights and
        their version."""
        cfg = self.cfg
        lora_argv = ["--lora", "--lora-r", str(cfg.lora_r), "--lora-alpha", str(cfg.lora_alpha)]
        lora_argv += ["--lora-target-modules", cfg.lora_target_modules]
        saved_dir, version = train_in_processes(
            cfg.train_processes,
            cfg.per_device_batch_size,
            self.start_dir(),
            self.it,
            fields,
            lora_argv if cfg.lora else None,
        )
        log_training_metrics(self.tracker, self.it / "train" / "metrics.jsonl")
        return saved_dir, version

    def _in_this_process(self, fields: dict[str, Any]) -> tuple[Path, str | None]:
        """The trainer built here (train/run.py's data and LoRA config), trained, and saved: the weights the next
        training starts from and their version."""
        import torch
        from transformers.trainer_callback import PrinterCallback

        from polar_mitm.train.data import load_sequences
        from polar_mitm.train.grpo_config import PolarGRPOConfig
        from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
        from polar_mitm.train.run import lora_config, training_data
        from polar_mitm.train.sync import attach_engine_push

        cfg, it = self.cfg, self.it
        data = training_data(load_sequences([it / "merged"]), fields)
        config = PolarGRPOConfig(
            output_dir=str(it / "train"),
            report_to=[],
            disable_tqdm=True,
            dataloader_pin_memory=torch.cuda.is_available(),  # pinned memory needs an accelerator (else a warning)
            **fields,
        )
        peft_config = lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules) if cfg.lora else None
        trainer = PolarGRPOTrainer(
            str(self.start_dir()), args=config, train_data=data, peft_config=peft_config
        )
        if config.push_every_steps:
            # Pushes during the training too; the last push stays the loop's push stage.
            attach_engine_push(trainer)
        trainer.remove_callback(
            PrinterCallback
        )  # the loop prints its own table; metrics.jsonl has every step
        for callback in [trainer_progress_callback(self.progress), *self.trainer_callbacks]:
            trainer.add_callback(callback)
        trainer.train()
        log_training_metrics(self.tracker, it / "train" / "metrics.jsonl")
        version = trainer.policy_weight_version()
        (it / "data_stats.json").write_text(json.dumps(data.stats.to_dict(), indent=2))
        (it / "train" / "grpo_config.json").write_text(
            config.to_json_string()
        )  # as `polar-mitm grpo` writes it
        # What the push stage loads, written before the run state: once that is saved, all is (see found_on_disk).
        trainer.save_for_engine(it / "train" / ENGINE_WEIGHTS_DIR)
        saved = trainer.save_final()
        return saved.get("merged", saved["model"]) if cfg.lora else saved["model"], version
