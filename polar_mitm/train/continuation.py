"""Training that continues: one optimizer across the loop's trainings (`run_state_dir`), a KL reference that stays
the run's initial policy (`reference_model`), and resuming a stopped `polar-mitm grpo` (`resume_from_checkpoint`).

`polar-mitm loop` trains once per iteration, in this process or as `--train-processes` torchrun processes that start
fresh every time, so the optimizer cannot live on in memory: each training saves it at its end and the next loads it
at its start. `run_state_dir` holds transformers' own checkpoint files for the optimizer (AdamW moments and
per-parameter step counts, `optimizer.pt`) and the LR scheduler (`scheduler.pt`), the LoRA adapter when there is one
(`adapter/`; full weights travel as the checkpoint the next training starts from), and `run_state.json` (`RunState`):
the trainings and optimizer steps so far, the LR schedule's horizon and the loss normalisers' constants
(train/normalisers.py), fixed by the first training.

The trainings of a run take different numbers of optimizer steps (dynamic sampling leaves 1 step in one iteration, 8
in the next), so a horizon of "the first training's steps × the trainings" would end too early or too late. Unless
`lr_schedule_steps` gives the horizon, each training re-plans where the schedule stands: from the position the run
has reached, it spreads the rest of the schedule over this training's steps × the trainings left (`SchedulePlan`, on
the scheduler, so `scheduler.pt` carries it and a resumed training continues its own plan). The LR is continuous
across trainings, a decaying schedule decays monotonically, and it reaches its end after the run's last step.

A kill in the middle of a save must leave the previous training's state usable (`polar-mitm loop --resume`), so a
save writes a sibling `<dir>.new` (`run_state.json` last: its presence marks the copy complete) and then swaps it in
with two renames; `recover_run_state` finishes or undoes a swap that a kill interrupted, and every reader calls it.

Resuming is transformers' `resume_from_checkpoint` (weights, optimizer, scheduler, RNG, step; the batches already
trained are skipped), plus what transformers does not know about: the step-0 behaviour check, which must stay the one
made against the weights that sampled the data (re-run at resume it would score the data against trained weights and
flag every row) — saved per row into each checkpoint and read back; and metrics.jsonl, cut back to the checkpoint's
step (`JsonlMetricsCallback`), so no step is written twice.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from polar_mitm.storage.run_layout import RUN_STATE_FILE
from polar_mitm.train.grpo_config import REFERENCE_AT_START

logger = logging.getLogger(__name__)


ADAPTER_DIR = "adapter"
BEHAVIOUR_ROWS_FILE = "behaviour_check_rows.json"  # in each checkpoint-N: sequence_id → step-0 mean |diff|
LAST_CHECKPOINT = "last"


@dataclass
class RunState:
    """The run so far, as the last training left it in `run_state_dir`."""

    trainings: int = 0  # trainings finished
    optimizer_steps: int = 0  # optimizer steps over all of them: where the LR schedule stands
    schedule_steps: int | None = (
        None  # the LR schedule's horizon (warmup included), fixed by the first training
    )
    save_seconds: float = 0.0  # what the last save of the directory took
    state_bytes: int = 0  # and how large the directory was
    policy_weight_version: str | None = None  # the version of the weights the last training left
    # Loss normalisers that are constants of the run (train/normalisers.py), fixed by the first training using them.
    dr_grpo_constant: int | None = None
    loss_tokens_per_step: float | None = None

    @classmethod
    def load(cls, directory: str | Path | None) -> RunState:
        """The state in `directory`; a fresh one (nothing trained yet) when there is none (call
        `recover_run_state` first where a save may have been killed)."""
        path = Path(directory) / RUN_STATE_FILE if directory else None
        if path is None or not path.exists():
            return cls()
        return cls(**json.loads(path.read_text()))

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / RUN_STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)  # a reader never sees half a file


def staging_dir(directory: str | Path) -> Path:
    """Where a save writes the next state before it replaces `directory` (the same name on every rank)."""
    directory = Path(directory)
    return directory.with_name(directory.name + ".new")


def _retired_dir(directory: Path) -> Path:
    return directory.with_name(directory.name + ".old")


def publish_run_state(directory: str | Path) -> None:
    """Swap the complete staging copy in for `directory`: at every instant one of the two is whole."""
    directory = Path(directory)
    staged, retired = staging_dir(directory), _retired_dir(directory)
    shutil.rmtree(retired, ignore_errors=True)
    if directory.exists():
        directory.rename(retired)
    staged.rename(directory)
    shutil.rmtree(retired, ignore_errors=True)


def recover_run_state(directory: str | Path) -> None:
    """After a kill: finish a swap whose staging copy is complete, else drop the partial copy and keep (or put
    back) the previous state."""
    directory = Path(directory)
    staged, retired = staging_dir(directory), _retired_dir(directory)
    if (staged / RUN_STATE_FILE).exists():
        publish_run_state(directory)
        return
    shutil.rmtree(staged, ignore_errors=True)
    if not directory.exists() and retired.exists():
        retired.rename(directory)
    shutil.rmtree(retired, ignore_errors=True)


def count_skipped_training(directory: str | Path) -> RunState:
    """A training that took no optimizer step (nothing to learn) still counts among the run's trainings, so the
    next one knows where it stands; optimizer, scheduler, adapter and weights stay as they are."""
    directory = Path(directory)
    recover_run_state(directory)
    state = RunState.load(directory)
    state.trainings += 1
    directory.mkdir(parents=True, exist_ok=True)
    state.save(directory)
    return state


def holds_optimizer(directory: str | Path) -> bool:
    """Whether `directory` has an optimizer and scheduler state to continue from."""
    directory = Path(directory)
    return (directory / OPTIMIZER_NAME).exists() and (directory / SCHEDULER_NAME).exists()


SCHEDULE_PLAN = (
    "polar_schedule_plan"  # the scheduler attribute holding this training's SchedulePlan (as a dict)
)


@dataclass(frozen=True)
class SchedulePlan:
    """How this training's optimizer steps map onto the run's LR schedule: from `start_step` (the run's optimizer
    steps before this training) at schedule position `start_position`, `rate` schedule steps per optimizer step.

    Saved as a dict of numbers in the scheduler's own attributes (LambdaLR's state_dict saves them all), so
    `scheduler.pt` in run_state_dir and in every checkpoint carries it; a scheduler saved without one maps 1:1."""

    start_step: int = 0
    start_position: float = 0.0
    rate: float = 1.0

    @classmethod
    def of(cls, scheduler: Any) -> SchedulePlan:
        saved = getattr(scheduler, SCHEDULE_PLAN, None)
        return cls(**saved) if saved else cls()

    def position(self, step: int) -> float:
        """Where optimizer step `step` (counted over the run) stands in the schedule."""
        return self.start_position + (step - self.start_step) * self.rate

    def attach(self, scheduler: Any) -> None:
        setattr(scheduler, SCHEDULE_PLAN, asdict(self))


def follow_plan(scheduler: Any, horizon: int) -> None:
    """Make a LambdaLR read its schedule at the position its `SchedulePlan` gives, held at `horizon` past it (linear
    would stay at 0, cosine would rise again).

    Closures, so the scheduler's state_dict saves none of them (it saves only callable objects' attributes); they
    look the plan up at every step, so a plan loaded with `scheduler.pt` takes effect."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return

    def position(step: int) -> float:
        return min(SchedulePlan.of(scheduler).position(step), horizon)

    scheduler.lr_lambdas = [lambda step, f=f: f(position(step)) for f in scheduler.lr_lambdas]


def replanned(
    current: SchedulePlan, steps_before: int, steps: int, trainings_left: int, horizon: int, fixed: bool
) -> SchedulePlan:
    """This training's plan: from where `current` left the run (after `steps_before` steps), the rest of the
    schedule spread over `steps` steps × `trainings_left` trainings; one schedule step per step when the horizon is
    `fixed` (`lr_schedule_steps`) or no training is left in the plan."""
    start = current.position(steps_before)
    rate = 1.0
    if not fixed and trainings_left >= 1 and start < horizon:
        rate = (horizon - start) / (steps * trainings_left)
    return SchedulePlan(steps_before, start, rate)


def checkpoint_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint directory (all its safetensors shards)."""
    from safetensors.torch import load_file

    shards = sorted(Path(directory).glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(shard))
    return weights


class ContinuationMixin:
    """`PolarGRPOTrainer`'s part that carries a run on (listed before TRL's `GRPOTrainer`, whose transformers
    methods `create_scheduler`, `train` and `_save_checkpoint` it extends)."""

    run_state: RunState
    schedule_steps: int | None = None
    _resuming = False

    def _init_continuation(self) -> None:
        """After TRL's init: the run so far, the carried LoRA adapter, the reference's weights."""
        directory = self.args.run_state_dir
        if directory and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            raise ValueError(
                "run_state_dir carries the optimizer with transformers' single-file optimizer state; "
                "DeepSpeed and FSDP shard it: continue those runs with resume_from_checkpoint"
            )
        if directory and self.accelerator.is_main_process:
            recover_run_state(directory)  # a save a kill interrupted: finished or undone before anyone reads
        self.accelerator.wait_for_everyone()
        self.run_state = RunState.load(directory)
        self._load_carried_adapter()
        self._load_reference_weights()

    # -- one optimizer across trainings ------------------------------------------------------------------------------

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The LR schedule over the whole run (`lr_schedule_steps`, or the horizon the first training fixed from
        `lr_schedule_trainings`), re-planned for this training's steps, and — the first point where optimizer and
        scheduler both exist — the carried state loaded into them."""
        created = self.lr_scheduler is None
        horizon = (
            self.args.lr_schedule_steps
            or self.run_state.schedule_steps
            or num_training_steps * self.args.lr_schedule_trainings
        )
        scheduler = super().create_scheduler(horizon, optimizer)
        if created:
            self.schedule_steps = horizon
            follow_plan(scheduler, horizon)
            directory = self.args.run_state_dir
            if directory and not self._resuming and holds_optimizer(directory):
                self._load_optimizer_and_scheduler(str(directory))
                logger.info(
                    "continuing the optimizer of %d earlier training(s), %d steps, from %s",
                    self.run_state.trainings,
                    self.run_state.optimizer_steps,
                    directory,
                )
            # (a resumed training's own plan then comes back with its checkpoint's scheduler.pt)
            self._plan_schedule(scheduler, num_training_steps, horizon)
        return scheduler

    def _plan_schedule(self, scheduler: Any, steps: int, horizon: int) -> None:
        """Attach this training's `SchedulePlan`; warn when its steps go past the schedule's end."""
        before = self.run_state.optimizer_steps
        plan = replanned(
            SchedulePlan.of(scheduler),
            before,
            steps,
            self.args.lr_schedule_trainings - self.run_state.trainings,
            horizon,
            fixed=self.args.lr_schedule_steps is not None,
        )
        plan.attach(scheduler)
        past = sum(plan.position(step) >= horizon for step in range(before, before + steps))
        if past:
            logger.warning(
                "the LR schedule ends after %d steps (%s): %d of this training's %d steps (run steps %d-%d) come "
                "after its end and keep its last LR; raise lr_schedule_steps or lr_schedule_trainings",
                horizon,
                "lr_schedule_steps" if self.args.lr_schedule_steps else "planned over lr_schedule_trainings",
                past,
                steps,
                before + 1,
                before + steps,
            )

    def save_run_state(self) -> Path:
        """Leave the optimizer, the scheduler, the LoRA adapter and the `RunState` in `run_state_dir`: written to
        the staging copy, swapped in once whole (a kill mid-save leaves the previous state)."""
        directory = Path(self.args.run_state_dir)
        staged = staging_dir(directory)
        started = time.monotonic()
        main = self.accelerator.is_main_process
        if main:
            shutil.rmtree(staged, ignore_errors=True)  # a copy a killed save left half-written
            staged.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self._save_optimizer_and_scheduler(str(staged))
        if self.is_peft and main:
            self.accelerator.unwrap_model(self.model).save_pretrained(staged / ADAPTER_DIR)
        self.accelerator.wait_for_everyone()
        if main:
            size = sum(p.stat().st_size for p in staged.rglob("*") if p.is_file())
            version = getattr(self, "policy_weight_version", None)
            state = replace(
                self.run_state,
                trainings=self.run_state.trainings + 1,
                optimizer_steps=self.run_state.optimizer_steps + self.state.global_step,
                schedule_steps=self.schedule_steps,
                save_seconds=time.monotonic() - started,
                state_bytes=size,
                policy_weight_version=version() if callable(version) else None,
            )
            state.save(staged)  # last: its presence marks the copy complete
            publish_run_state(directory)
            logger.info(
                "optimizer state (%.1f MB) saved to %s in %.2f s", size / 1e6, directory, state.save_seconds
            )
        self.accelerator.wait_for_everyone()
        return directory

    def _load_carried_adapter(self) -> None:
        """With LoRA the model starts from the base: the adapter trained so far comes from `run_state_dir`."""
        directory = self.args.run_state_dir
        adapter = Path(directory) / ADAPTER_DIR / "adapter_model.safetensors" if directory else None
        if adapter is None or not self.is_peft or not adapter.exists():
            return
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        loaded = set_peft_model_state_dict(self.accelerator.unwrap_model(self.model), load_file(adapter))
        if loaded.unexpected_keys:
            raise ValueError(
                f"{adapter} does not fit this LoRA configuration: {loaded.unexpected_keys[:3]} …"
            )

    def _load_reference_weights(self) -> None:
        """`reference_model`: the KL reference holds that checkpoint's weights instead of the starting model's."""
        source = self.args.reference_model
        if self.beta == 0.0 or source in (None, REFERENCE_AT_START):
            return
        path = Path(source).resolve()
        if self.model_source is not None and path == self.model_source.resolve():
            return  # the starting model: what TRL loaded
        if self.is_peft:
            raise ValueError(
                "with LoRA the KL reference is the base model (the adapter disabled): start from "
                f"{source} instead of naming it as reference_model"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("reference_model is loaded in place, which ZeRO-3/FSDP shards do not allow")
        reference = self.accelerator.unwrap_model(self.ref_model)
        missing, unexpected = reference.load_state_dict(checkpoint_weights(path), strict=False)
        params = dict(reference.named_parameters(remove_duplicate=False))
        loaded = {name for name in params if name not in missing}
        untied = [m for m in missing if not any(params[m] is params[k] for k in loaded)]
        if unexpected or untied:
            raise ValueError(
                f"{source} is not a checkpoint of this model: missing {untied[:3]}, unexpected {unexpected[:3]}"
            )

    # -- resume ------------------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """transformers' `train`, with `last` for the newest checkpoint and the step-0 behaviour check restored."""
        checkpoint = self._resolve_checkpoint(resume_from_checkpoint)
        self._resuming = checkpoint is not None
        if checkpoint is not None:
            self._restore_behaviour_check(checkpoint)
        try:
            return super().train(resume_from_checkpoint=checkpoint, **kwargs)
        finally:
            self._resuming = False

    def _resolve_checkpoint(self, value: str | bool | None) -> str | None:
        if value is None or value is False:
            return None
        if value is True or value == LAST_CHECKPOINT:
            last = get_last_checkpoint(self.args.output_dir) if Path(self.args.output_dir).is_dir() else None
            if last is None:
                raise FileNotFoundError(
                    f"no {PREFIX_CHECKPOINT_DIR}-N in {self.args.output_dir} to resume from"
                )
            return last
        if not Path(value).is_dir():
            raise FileNotFoundError(f"no checkpoint at {value}")
        return str(value)

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' checkpoint, plus the step-0 behaviour check per row (what a resume must not re-run)."""
        super()._save_checkpoint(model, trial)
        if not self.args.should_save or self.behaviour_logp_diff is None:
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        rows, excess = self.train_data.rows, self.behaviour_ratio_excess
        values = {
            rows[i]["sequence_id"]: [diff, *excess.get(i, ())] for i, diff in self.behaviour_logp_diff.items()
        }
        (folder / BEHAVIOUR_ROWS_FILE).write_text(json.dumps(values))

    def _restore_behaviour_check(self, checkpoint: str) -> None:
        if not self.args.check_behaviour_logps:
            return
        path = Path(checkpoint) / BEHAVIOUR_ROWS_FILE
        if not path.exists():
            logger.warning(
                "%s holds no step-0 behaviour check: it is skipped, not re-run against trained weights",
                checkpoint,
            )
            self.behaviour_logp_diff = {}
            return
        by_sequence = json.loads(path.read_text())
        saved = {
            i: by_sequence[r["sequence_id"]]
            for i, r in enumerate(self.train_data.rows)
            if r["sequence_id"] in by_sequence
        }
        self.behaviour_logp_diff = {i: values[0] for i, values in saved.items()}
        self.behaviour_ratio_excess = {
            i: tuple(values[1:]) for i, values in saved.items() if len(values) == 4
        }
