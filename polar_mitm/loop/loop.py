"""`polar-mitm loop`: rollout → merge → GRPO → push weights → repeat.

Each iteration: the run's gateway (up for the whole run, loop_gateways.py) writes the iteration's records to
`RUN/iter-K/flows`, G harness sessions per task run through it (the staged rollout), `merge` joins the records
into sequences with the rewards, GRPO trains on them, and the new weights are pushed to the engine
(`/update_weights_from_disk`), whose `weight_version` then appears in the next iteration's records.

`--overlap N` rolls out up to N iterations ahead of the trainer (Polar's asynchronous design): a thread runs the
rollouts (and merges) in order, iteration K+N's while iteration K trains, so their data is up to N weight versions
behind; the trainer's importance ratios against the recorded behaviour logprobs correct for it, and every call's
staleness (its record's weight_version against the weights being trained) is in the trainer's metrics. A push lands
while sessions are mid-flight: their later calls carry the new version, and each call is corrected by its own.

`--resume` carries a killed run on from its run directory (run_state.py): each stage of an iteration (rollout, merge,
train, push, eval) leaves a marker in `iter-K/state.json`; finished sessions are journalled as they finish, so an
interrupted rollout re-runs only the others, under new session ids; a training is redone from the last saved
optimizer state unless it finished saving; the engine is brought back to the last trained weights at start.

The iterations share one optimizer: each training continues the AdamW state, the LR schedule (spanning all
iterations) and the step count of the one before (`RUN/trainer-state`, see train/continuation.py), whether it runs
in this process or as `--train-processes` processes, and the KL reference stays the run's initial model. Every
`polar-mitm grpo` option is a loop option too (loop/cli.py's `loop_trainer_options`), but for the few the loop
sets (`LOOP_SETS`).

`--eval-tasks FILE` evaluates the policy on tasks it never trains on, every `--eval-every` iterations: N sessions per
task (`--eval-samples`), records under `RUN/eval-K/` (never merged), pass@1 and unbiased pass@k (evaluation.py).
`--report-to tensorboard|mlflow|wandb` sends the per-iteration figures, the evaluations and the trainer's per-step
metrics to one tracked run (trackers.py), and RUN/report.html is rewritten after every iteration (report/live.py).
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines import router, weights
from polar_mitm.loop.config import (
    LOOP_TRAINER_DEFAULTS,
    LoopConfig,
)
from polar_mitm.loop.evaluation import EvalResult, check_held_out, eval_due, evaluation_result
from polar_mitm.loop.figures import (
    IterationStats,
    MergeFigures,
    call_staleness,
    eval_metrics,
    iteration_stats,
    stats_from_json,
)
from polar_mitm.loop.gateways import LoopGateways
from polar_mitm.loop.informative import (
    GroupSampler,
    check_dynamic_sampling,
    group_sampler,
    sample_groups,
)
from polar_mitm.loop.progress import LoopProgress, NoProgress, trainer_progress_callback
from polar_mitm.loop.run_state import (
    IterationState,
    SessionJournal,
    append_event,
    config_differences,
    in_run_dir,
    journal_finished,
    prune_checkpoints,
    record_run,
    recorded_run_dir,
    renumbered,
    session_from_row,
    stored_path,
    write_json_atomic,
)
from polar_mitm.loop.trackers import (
    TENSORBOARD_DIR,
    NoTracker,
    Tracker,
    check_tracker,
    log_training_metrics,
    open_tracker,
)
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig, RolloutSummary, write_rewards
from polar_mitm.storage.location import private_dir
from polar_mitm.storage.run_layout import (
    ENGINE_WEIGHTS_DIR,
    EVENTS_FILE,
    LOOP_FILE,
    RUN_STATE_DIR,
    SKIPPED_TRAINING_FILE,
    START_EVAL_DIR,
    iteration_dir,
)
from polar_mitm.tasks.task_file import Task, load_tasks
from polar_mitm.train.launch import train_in_processes

if TYPE_CHECKING:
    from polar_mitm.rollout.ray_driver import RayPool

logger = logging.getLogger(__name__)


class Loop:
    """Owns the engine and the gateways for the whole run; a record directory per iteration.

    `trainer_callbacks`: extra transformers `TrainerCallback`s for each training run in this process (the loop adds
    its progress line and the engine push itself)."""

    def __init__(
        self,
        cfg: LoopConfig,
        on_iteration=None,
        progress: LoopProgress | None = None,
        trainer_callbacks: list | None = None,
    ) -> None:
        self.cfg = cfg
        self.tasks: list[Task] = load_tasks(cfg.tasks)
        self.eval_tasks: list[Task] = load_tasks(cfg.eval_tasks) if cfg.eval_tasks else []
        self.start_eval: EvalResult | None = None  # --eval-start's result, once run() has it
        if cfg.eval_tasks:
            check_held_out(self.tasks, self.eval_tasks)
            if cfg.eval_every < 1 or cfg.eval_samples < 1:
                raise ValueError("--eval-every and --eval-samples must be at least 1")
        if cfg.gateways < 1 or (cfg.gateways > 1 and cfg.ray_address is not None):
            raise ValueError("--gateways must be at least 1 (and is 1 with --ray: one gateway per node)")
        check_tracker(cfg.report_to)  # refused before the engine starts
        self.tracker: Tracker = NoTracker()  # run() opens the --report-to one
        self.on_iteration = on_iteration or (lambda stats: None)
        self.progress: LoopProgress = progress or NoProgress()
        self.trainer_callbacks = list(trainer_callbacks or [])
        self.initial_model_dir: Path | None = None  # the run's starting model: LoRA's base, the KL reference
        self.model_dir: Path | None = None  # the newest weights (the next training starts from them)
        self.weight_version = "0"  # of self.model_dir, as the engine numbers it
        self.engine_url = cfg.engine_url
        self.ray_pool: RayPool | None = None  # with --ray: the node actors, kept for the whole run
        self.tasks_by_id = {t.task_id: t for t in self.tasks}
        self._states: dict[int, IterationState] = {}  # iter-K/state.json, one writer object per iteration
        self.loop_gateways: LoopGateways | None = None  # up from the first local rollout to the run's end
        self._states_lock = threading.Lock()
        # Where the run was started (run() sets it, _resumed takes it from run.json): paths its files hold that
        # point there are read under cfg.run_dir, so a copied or moved run resumes where it is.
        self.recorded_run_dir = cfg.run_dir

    # -- stages --------------------------------------------------------------------------------------------------

    def _gateways(self) -> LoopGateways:
        if self.loop_gateways is None:
            self.loop_gateways = LoopGateways(
                router.gateway_backends(self.engine_url, self.cfg.gateways),
                self.cfg.run_dir,
                confdir=self.cfg.run_dir / "mitmproxy",
            )
        return self.loop_gateways

    def _close_gateways(self) -> None:
        if self.loop_gateways is not None:
            self.loop_gateways.close()

    def _gateway_options(self, temperature: float | None = None) -> dict[str, str]:
        """Every gateway of the run forces the training temperature (or the evaluation's) and the completion
        budget."""
        return {
            "polar_temperature": str(self.cfg.temperature if temperature is None else temperature),
            "polar_max_tokens": str(self.cfg.max_tokens),
            **router.gateway_options(self.engine_url),
        }

    def _rollout(self, k: int) -> tuple[RolloutSummary, Path, Path, float]:
        check_dynamic_sampling(self.cfg)
        if self.cfg.ray_address is not None:
            return self._ray_rollout(k)  # one gateway per node, records under iter-K/flows/node-*/
        started = time.monotonic()
        it = iteration_dir(self.cfg.run_dir, k)
        # --min-informative-groups: N groups, flat ones replaced (informative.py); the final rollout measures all tasks
        sampler = group_sampler(self.cfg, self.tasks, k) if k < self.cfg.iterations else None
        tasks = self.tasks if sampler is None else sampler.first_wave()
        self.progress.stage(k, "rollout", len(tasks) * self.cfg.group_size)
        summary = self._local_rollout(it, tasks, self.cfg.group_size, self._gateway_options(), sampler)
        write_rewards(summary, it / "rewards.parquet")
        return summary, it / "flows", it / "rewards.parquet", time.monotonic() - started

    def _local_rollout(
        self,
        it: Path,
        tasks: list[Task],
        group_size: int,
        gateway_options: dict[str, str],
        sampler: GroupSampler | None = None,
    ) -> RolloutSummary:
        """`group_size` sessions per task through a gateway of their own, records under `it/flows`; with a
        `sampler` (whose first wave `tasks` is), its replacement waves follow through the same gateway."""
        import asyncio

        cfg = self.cfg
        it.mkdir(parents=True, exist_ok=True)
        finished_before = [0]  # sessions of earlier waves, for the progress line

        async def run_wave(wave: list[Task]) -> RolloutSummary:
            total = finished_before[0] + len(wave) * group_size
            rollout = Rollout(
                wave,
                HarnessSpec(cfg.harness),
                endpoints,
                RolloutConfig(
                    group_size=group_size,
                    concurrency=cfg.concurrency,
                    keep=cfg.keep,
                    workspace_root=it / "workspaces",
                    log_dir=it / "logs",
                ),
            )
            rollout.on_update = lambda sessions: self.progress.advance(
                finished_before[0] + sum(s.stage == "done" for s in sessions), total
            )
            journal_finished(rollout, it)  # --resume keeps the sessions that finished (run_state.py)
            summary = await rollout.run()
            finished_before[0] += len(summary.sessions)
            return summary

        # The run's gateways, pointed at this rollout's folder; its records are complete shards after the block.
        with self._gateways().serving(it / "flows", gateway_options) as gateways:
            endpoints = [GatewayEndpoints.of(gw) for gw in gateways]
            if sampler is None:
                return asyncio.run(run_wave(tasks))
            return asyncio.run(sample_groups(sampler, run_wave))

    def _evaluate(self, k: int, it: Path | None = None) -> EvalResult:
        """The served weights on the held-out tasks: records and rewards under RUN/eval-K (or `it`), which no merge
        reads (the loop merges only iter-K/flows)."""
        cfg, it = self.cfg, it or self.cfg.run_dir / f"eval-{k}"
        self.progress.stage(k, "eval", len(self.eval_tasks) * cfg.eval_samples)
        temperature = 0.0 if cfg.eval_greedy else cfg.temperature
        summary = self._local_rollout(
            it, self.eval_tasks, cfg.eval_samples, self._gateway_options(temperature)
        )
        write_rewards(summary, it / "rewards.parquet")
        result = evaluation_result(
            summary,
            iteration=k,
            weight_version=self.weight_version,
            samples=cfg.eval_samples,
            greedy=cfg.eval_greedy,
        )
        write_json_atomic(it / "eval.json", result.to_json())
        return result

    def _ray_rollout(self, k: int) -> tuple[RolloutSummary, Path, Path, float]:
        """`--ray`: iteration K's rollout on the cluster (the node actors live for the whole run)."""
        from polar_mitm.rollout.ray_driver import RayPool, write_report

        cfg, it = self.cfg, iteration_dir(self.cfg.run_dir, k)
        started = time.monotonic()
        it.mkdir(parents=True, exist_ok=True)
        if self.ray_pool is None:
            self.ray_pool = RayPool(cfg.ray_address or "auto", cfg.harness)
        config = RolloutConfig(group_size=cfg.group_size, concurrency=cfg.concurrency, keep=cfg.keep)
        result = self.ray_pool.rollout(
            self.tasks,
            config,
            out_dir=it / "flows",
            work_dir=it,
            engine_url=self.engine_url,
            gateway_options=self._gateway_options(),
        )
        write_rewards(result.summary, it / "rewards.parquet")
        write_report(result, it / "ray_report.json")
        if result.interrupted is not None:
            raise KeyboardInterrupt
        return result.summary, it / "flows", it / "rewards.parquet", time.monotonic() - started

    def _merge(self, k: int, flows: Path, rewards: Path) -> tuple[Any, float]:
        from polar_mitm.reconstruct.merge import merge

        started = time.monotonic()
        self.progress.stage(k, "merge")
        merged = iteration_dir(self.cfg.run_dir, k) / "merged"
        shutil.rmtree(merged, ignore_errors=True)  # what a merge a kill interrupted left
        summary = merge(
            [str(flows)],
            str(merged),
            builder=self.cfg.builder,
            rewards=str(rewards),
            # The run's tokenizer never changes; the initial model's copy is never pruned or written to.
            tokenizer=str(self.initial_model_dir),
            # Sessions a killed rollout left unfinished have records but no reward: never trained on.
            drop_unrewarded=True,
        )
        return summary, time.monotonic() - started

    def trainer_fields(self) -> dict[str, Any]:
        """The PolarGRPOConfig fields of the next iteration's training: `cfg.grpo` over the loop's defaults, then
        what the loop sets (LOOP_SETS) — the same for a training in this process or in `--train-processes` ones."""
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
            run_state_dir=str(cfg.run_dir / RUN_STATE_DIR),
            lr_schedule_trainings=cfg.iterations,
            save_merged=True,
            # The initial policy unless asked otherwise (`start`: each iteration's own starting weights).
            reference_model=str(self.initial_model_dir) if reference is None else reference,
        )
        fields.pop("resume_from_checkpoint", None)
        return fields

    def _train_start(self) -> Path:
        """LoRA trains adapters on the initial model (the adapter so far comes from RUN/trainer-state); full
        weights continue from the newest checkpoint."""
        start = self.initial_model_dir if self.cfg.lora else self.model_dir
        assert start is not None, "the loop's model is resolved in run()"
        return start

    def _train(self, k: int) -> tuple[Path, str | None, float]:
        import torch

        from polar_mitm.train.data import load_sequences
        from polar_mitm.train.grpo_config import PolarGRPOConfig
        from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
        from polar_mitm.train.run import lora_config, training_data
        from polar_mitm.train.sync import attach_engine_push

        cfg, it = self.cfg, iteration_dir(self.cfg.run_dir, k)
        started = time.monotonic()
        self.progress.stage(k, "train")
        fields = self.trainer_fields()
        if cfg.train_processes > 1:
            lora_argv = ["--lora", "--lora-r", str(cfg.lora_r), "--lora-alpha", str(cfg.lora_alpha)]
            lora_argv += ["--lora-target-modules", cfg.lora_target_modules]
            saved_dir, version = train_in_processes(
                cfg.train_processes,
                cfg.per_device_batch_size,
                self._train_start(),
                it,
                fields,
                lora_argv if cfg.lora else None,
            )
            log_training_metrics(self.tracker, it / "train" / "metrics.jsonl")
            return saved_dir, version, time.monotonic() - started
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
            str(self._train_start()), args=config, train_data=data, peft_config=peft_config
        )
        if config.push_every_steps:
            # Pushes during the training too; the last push stays the loop's push stage.
            attach_engine_push(trainer)
        from transformers.trainer_callback import PrinterCallback

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
        # What the push stage loads, written before the run state: once that is saved, all is (see _trained_on_disk).
        trainer.save_for_engine(it / "train" / ENGINE_WEIGHTS_DIR)
        saved = trainer.save_final()
        return (
            saved.get("merged", saved["model"]) if cfg.lora else saved["model"],
            version,
            time.monotonic() - started,
        )

    def _final_rollout(self, k: int) -> IterationStats:
        """Rollout + merge with the last pushed weights, no training: the reward the trained policy earns."""
        summary, flows, rewards, rollout_s = self._rollout_stage(k)
        merged, merge_s = self._merge_stage(k, flows, rewards)  # kept for `polar-mitm report` and `show`
        seconds = {"rollout": rollout_s, "merge": merge_s, "train": 0.0}
        return iteration_stats(k, self.weight_version, summary, merged, seconds)

    # -- resumable stages (iter-K/state.json: run_state.py) ---------------------------------------------------

    def _in_run(self, stored: str) -> Path:
        """A path a stage marker holds, in the run directory as it is now (run_state.in_run_dir)."""
        return in_run_dir(stored, self.cfg.run_dir, self.recorded_run_dir)

    def _state(self, k: int) -> IterationState:
        with self._states_lock:
            if k not in self._states:
                self._states[k] = IterationState(iteration_dir(self.cfg.run_dir, k), k)
            return self._states[k]

    def _rollout_stage(self, k: int) -> tuple[RolloutSummary, Path, Path, float]:
        """Iteration k's rollout: done before (its rewards file), finished in part (the journalled sessions kept,
        the rest run now), or run whole."""
        it, state = iteration_dir(self.cfg.run_dir, k), self._state(k)
        if state.done("rollout"):
            summary = rewarded_summary(it / "rewards.parquet", self.tasks_by_id, state.info("rollout"))
            return summary, it / "flows", it / "rewards.parquet", state.info("rollout")["seconds"]
        state.begin("rollout")
        finished = SessionJournal(it).rows()
        if finished and self.cfg.ray_address is None:
            summary, flows, rewards, seconds = self._rerun_unfinished(k, finished)
        else:
            # Nothing finished to keep (or --ray, whose node records are not journalled): the rollout runs whole,
            # the records of an attempt a kill interrupted set aside.
            set_aside(it / "flows")
            summary, flows, rewards, seconds = self._rollout(k)
        state.finish(
            "rollout",
            seconds=seconds,
            sessions=len(summary.sessions),
            kept_sessions=len(finished),
            replaced_groups=getattr(summary, "replaced_groups", 0),
        )
        return summary, flows, rewards, seconds

    def _rerun_unfinished(
        self, k: int, finished: list[dict[str, Any]]
    ) -> tuple[RolloutSummary, Path, Path, float]:
        """A rollout a kill interrupted: its finished sessions kept, each group's missing ones run under new ids
        (their records go beside the old ones; the killed sessions' records have no reward, so no merge uses them).
        Groups drawn to replace flat ones (--min-informative-groups) are completed, not drawn again."""
        cfg, it = self.cfg, iteration_dir(self.cfg.run_dir, k)
        started = time.monotonic()
        kept = [session_from_row(row, self.tasks_by_id) for row in finished]
        planned = self._planned_tasks(k, kept)
        have = Counter(s.task.task_id for s in kept)
        # One session per entry, a task listed once per missing session: one gateway for all of them.
        missing = [task for task in planned for _ in range(max(cfg.group_size - have[task.task_id], 0))]
        self.progress.stage(k, "rollout", len(missing))
        rerun = self._local_rollout(it, missing, 1, self._gateway_options()).sessions if missing else []
        summary = RolloutSummary(kept + renumbered(rerun, kept), time.monotonic() - started, 0.0)
        write_rewards(summary, it / "rewards.parquet")
        return summary, it / "flows", it / "rewards.parquet", time.monotonic() - started

    def _planned_tasks(self, k: int, kept: list) -> list[Task]:
        """The task groups iteration k rolls out: every task (or the dynamic sampler's first wave), and any group a
        kept session belongs to."""
        sampler = group_sampler(self.cfg, self.tasks, k) if k < self.cfg.iterations else None
        planned = self.tasks if sampler is None else sampler.first_wave()
        seen = {t.task_id for t in planned}
        return planned + [
            self.tasks_by_id[i] for i in dict.fromkeys(s.task.task_id for s in kept) if i not in seen
        ]

    def _merge_stage(self, k: int, flows: Path, rewards: Path) -> tuple[MergeFigures, float]:
        state = self._state(k)
        if not state.done("merge"):
            state.begin("merge")
            merged, seconds = self._merge(k, flows, rewards)
            state.finish("merge", figures=asdict(MergeFigures.of(merged)), seconds=seconds)
        info = state.info("merge")
        return MergeFigures(**info["figures"]), info["seconds"]

    def _train_stage(self, k: int) -> tuple[Path, str | None, float]:
        """Iteration k's training (unless done: its marker, or a training that saved all before a kill) and the push
        of its weights."""
        it, state = iteration_dir(self.cfg.run_dir, k), self._state(k)
        if not state.done("train"):
            state.begin("train")
            base = self.weight_version  # what the training starts from (staleness is measured against it)
            skipped = self._skipped_training(k)
            model_dir, version, seconds = skipped or self._trained_on_disk(k) or self._train(k)
            state.finish(
                "train",
                model_dir=stored_path(model_dir, self.cfg.run_dir),
                weight_version=version,
                seconds=seconds,
                base_weight_version=base,
                skipped=skipped is not None,
            )
        info = state.info("train")
        if not state.done("push"):
            state.begin("push")
            if not info.get("skipped"):  # the engine already serves these weights
                self._push(it, info["weight_version"])
            state.finish("push", weight_version=info["weight_version"])
        return self._in_run(info["model_dir"]), info["weight_version"], info["seconds"]

    def _skipped_training(self, k: int) -> tuple[Path, str | None, float] | None:
        """No training when every group of iteration k is flat (one reward per group): there is no policy
        gradient, yet AdamW's momentum and weight decay would still move the weights (issue 29's capstone run: the
        flat iterations were half its training time, and its KL rose on them). The weights, the optimizer and the
        LR schedule stay; the training still counts (RunState), and `RUN/iter-K/train/skipped.json` says why.
        --grpo keep_zero_advantage_groups=true trains on flat groups anyway."""
        from polar_mitm.train.continuation import RunState, count_skipped_training, recover_run_state
        from polar_mitm.train.data import load_sequences
        from polar_mitm.train.run import training_data

        started = time.monotonic()
        it, directory = iteration_dir(self.cfg.run_dir, k), self.cfg.run_dir / RUN_STATE_DIR
        marker = it / "train" / SKIPPED_TRAINING_FILE
        if not marker.exists():
            fields = self.trainer_fields()
            if fields.get("keep_zero_advantage_groups"):
                return None
            rows = [
                r
                for r in training_data(load_sequences([it / "merged"]), fields).rows
                if not r.get("placeholder")
            ]
            if not rows or any(float(r["advantage"]) != 0.0 for r in rows):
                return None
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
        skipped = json.loads(marker.read_text())
        recover_run_state(directory)
        if RunState.load(directory).trainings == k:  # not counted yet (a kill may have come in between)
            count_skipped_training(directory)
        append_event(self.cfg.run_dir, "train_skipped", k, "train", sequences=skipped["sequences"])
        logger.warning(
            "iteration %d: every group is flat (equal rewards): no optimizer step, the weights stay", k
        )
        return self._in_run(skipped["model_dir"]), skipped["weight_version"], time.monotonic() - started

    def _trained_on_disk(self, k: int) -> tuple[Path, str | None, float] | None:
        """The training of iteration k when a kill came after it saved everything (the optimizer state counts it);
        None when it must run, with what an interrupted one left removed."""
        from polar_mitm.train.continuation import RunState, recover_run_state

        it, directory = iteration_dir(self.cfg.run_dir, k), self.cfg.run_dir / RUN_STATE_DIR
        recover_run_state(directory)
        run_state = RunState.load(directory)
        if run_state.trainings == k + 1:
            log_training_metrics(self.tracker, it / "train" / "metrics.jsonl")
            trained = it / "train" / "merged" if self.cfg.lora else it / "train"
            return trained, run_state.policy_weight_version, 0.0
        if run_state.trainings != k:
            raise RuntimeError(
                f"{directory} holds {run_state.trainings} trainings; iteration {k} must follow {k} of them"
            )
        shutil.rmtree(it / "train", ignore_errors=True)  # a training the kill interrupted starts over
        return None

    def _push(self, it: Path, version: str | None) -> None:
        """The engine serves `version` (the trained weights of `it`) after this: pushed unless it already does."""
        if version is None or self.engine_url is None:  # no engine: a training driven alone (tests)
            return
        if weights.common_weight_version(self.engine_url) == version:
            return
        weights.push_weights(self.engine_url, it / "train" / ENGINE_WEIGHTS_DIR, weight_version=version)

    def _eval_stage(self, k: int) -> EvalResult | None:
        cfg, state = self.cfg, self._state(k)
        if not (self.eval_tasks and eval_due(k, cfg.eval_every, cfg.iterations)):
            return None
        if not state.done("eval"):
            state.begin("eval")
            # An evaluation a kill interrupted runs again whole (its records are never trained on).
            shutil.rmtree(cfg.run_dir / f"eval-{k}", ignore_errors=True)
            result = self._evaluate(k)
            state.finish("eval", result=result.to_json())
            append_event(cfg.run_dir, "eval_done", k, "eval", pass_at=result.pass_at)
        return EvalResult(**state.info("eval")["result"])

    def _start_eval_stage(self) -> EvalResult | None:
        """--eval-start: the starting weights on the held-out tasks, once per run (a resume finds its eval.json;
        one a kill interrupted runs again whole), tracked at step -1, before iteration 0's figures."""
        cfg = self.cfg
        if not (cfg.eval_start and self.eval_tasks):
            return None
        it = cfg.run_dir / START_EVAL_DIR
        if not (it / "eval.json").exists():
            shutil.rmtree(it, ignore_errors=True)
            result = self._evaluate(-1, it)
            append_event(cfg.run_dir, "eval_done", -1, "eval", pass_at=result.pass_at)
        result = EvalResult(**json.loads((it / "eval.json").read_text()))
        self.tracker.log(eval_metrics(result), step=-1)
        return result

    def _iteration(self, k: int, rolled: tuple, merged: tuple[MergeFigures, float]) -> IterationStats:
        """Iteration k after its rollout and merge: train, push, evaluate; its figures."""
        summary, _, _, rollout_s = rolled
        figures, merge_s = merged
        self.model_dir, version, train_s = self._train_stage(k)
        base = self._state(k).info("train").get("base_weight_version")
        self.weight_version = version or self.weight_version
        seconds = {"rollout": rollout_s, "merge": merge_s, "train": train_s}
        stats = iteration_stats(k, version, summary, figures, seconds)
        stats.call_staleness = call_staleness(iteration_dir(self.cfg.run_dir, k), base)
        stats.train_skipped = bool(self._state(k).info("train").get("skipped"))
        stats.eval = self._eval_stage(k)
        return stats

    def _done(self, stats: IterationStats, results: list[IterationStats]) -> None:
        """An iteration is finished: in loop.json (what makes it done), its marker, the events, the report."""
        cfg, k = self.cfg, stats.iteration
        results.append(stats)
        write_json_atomic(cfg.run_dir / LOOP_FILE, [r.to_json() for r in results])
        self._state(k).finish("done")
        append_event(cfg.run_dir, "iteration_done", k, None, weight_version=stats.weight_version)
        self._report(stats)
        if cfg.keep_checkpoints is not None and k < cfg.iterations:
            prune_checkpoints(cfg.run_dir, cfg.keep_checkpoints, last_trained=k)

    # -- driver --------------------------------------------------------------------------------------------------

    def run(self) -> list[IterationStats]:
        from polar_mitm.engine.model_zoo import resolve_model

        cfg = self.cfg
        cfg.run_dir = cfg.run_dir.resolve()
        self.recorded_run_dir = cfg.run_dir
        private_dir(cfg.run_dir)  # owner-only: records, rewards, the run state (issue 36 item 2)
        self.model_dir = self.initial_model_dir = resolve_model(cfg.model, seed=cfg.seed)
        results = self._resumed() if cfg.resume else self._started()
        with ExitStack() as running:
            # --resume continues the same tracked run (TensorBoard's directory, MLflow's and W&B's run ids in RUN/)
            self.tracker = open_tracker(cfg.report_to, cfg.run_dir, resume=cfg.resume)
            running.callback(self.tracker.close)  # last: after the final figures
            self._replay_tracked(results)
            # Ours unless given: the embedded engine; given, one engine, SGLang's router, or a comma list (we start
            # the router).
            engine_url = running.enter_context(
                engine_processes.engine_running(
                    self.engine_url,
                    model=str(self.model_dir),
                    log=cfg.run_dir / "engine.log",
                    extra_args=["--script", str(cfg.script)] if cfg.script else [],
                )
            )
            self.engine_url = running.enter_context(
                router.attached(engine_url, log=cfg.run_dir / "router.log")
            ).url
            running.callback(
                self._close_gateways
            )  # before the engine goes: the gateways compact their journals
            if cfg.engine_url is not None and self.model_dir == self.initial_model_dir:  # nothing trained yet
                self.weight_version = weights.common_weight_version(self.engine_url) or "0"
            self._restore_engine()
            self.start_eval = self._start_eval_stage()
            running.callback(self._close_ray_pool)  # first: the node actors stop their gateways
            self._iterate(results)
            if cfg.final_rollout and len(results) == cfg.iterations:
                self._done(self._final_rollout(cfg.iterations), results)
            write_json_atomic(cfg.run_dir / LOOP_FILE, [r.to_json() for r in results])
            append_event(cfg.run_dir, "finished", len(results) - 1, None, weight_version=self.weight_version)
        return results

    def _iterate(self, results: list[IterationStats]) -> None:
        """The iterations not done yet: in turn, or (--overlap N) with rollouts up to N iterations ahead."""
        cfg, start = self.cfg, len(results)
        if cfg.overlap < 1:
            for k in range(start, cfg.iterations):
                rolled = self._rollout_stage(k)
                merged = self._merge_stage(k, rolled[1], rolled[2])
                self._done(self._iteration(k, rolled, merged), results)
            return
        with RolloutsAhead(self, start, cfg.overlap) as ahead:
            for k in range(start, cfg.iterations):
                rolled, merged = ahead.get(k)
                self._done(self._iteration(k, rolled, merged), results)
                ahead.trained()

    def _started(self) -> list[IterationStats]:
        """A new run: the command recorded; a new optimizer and a new tracked run, even in a reused directory."""
        cfg = self.cfg
        for stale in (RUN_STATE_DIR, f"{RUN_STATE_DIR}.new", f"{RUN_STATE_DIR}.old", TENSORBOARD_DIR):
            shutil.rmtree(cfg.run_dir / stale, ignore_errors=True)
        for marker in [*cfg.run_dir.glob("iter-*/state.json"), *cfg.run_dir.glob("iter-*/sessions.jsonl")]:
            marker.unlink()  # an earlier run's progress is not this one's
        for name in (LOOP_FILE, EVENTS_FILE):
            (cfg.run_dir / name).unlink(missing_ok=True)
        record_run(cfg.run_dir, cfg)
        append_event(cfg.run_dir, "start", 0, "rollout")
        return []

    def _resumed(self) -> list[IterationStats]:
        """--resume: the finished iterations (loop.json), and the weights to go on from (model_dir,
        weight_version) — the last training that finished, which may belong to the iteration resumed."""
        from polar_mitm.loop.saved_state import check_saved_run

        cfg = self.cfg
        recorded = check_saved_run(cfg.run_dir)  # every file read below, checked before the engine starts
        self.recorded_run_dir = recorded_run_dir(cfg.run_dir)
        differences = config_differences(recorded, vars(cfg))
        if differences:
            raise ValueError(
                f"--resume: {cfg.run_dir} was started with other settings: {'; '.join(differences)}"
            )
        rows = json.loads((cfg.run_dir / LOOP_FILE).read_text()) if (cfg.run_dir / LOOP_FILE).exists() else []
        results = [stats_from_json(row) for row in rows]
        start = len(results)
        trained = [k for k in (start, start - 1) if 0 <= k < cfg.iterations and self._state(k).done("train")]
        if trained:
            info = self._state(trained[0]).info("train")
            self.model_dir, self.weight_version = self._in_run(info["model_dir"]), info["weight_version"]
        stage = self._state(start).first_unfinished()
        append_event(cfg.run_dir, "resume", start, stage, weight_version=self.weight_version)
        return results

    def _replay_tracked(self, results: list[IterationStats]) -> None:
        """On --resume: the finished iterations' figures and training metrics to the trackers again; each tracker
        takes only the points it lacks (W&B's writer process may not have put the last ones on disk before a kill;
        trackers.py)."""
        for stats in results:
            self.tracker.log(stats.tracked_metrics(), step=stats.iteration)
            metrics = self.cfg.run_dir / f"iter-{stats.iteration}" / "train" / "metrics.jsonl"
            if metrics.exists():
                log_training_metrics(self.tracker, metrics)

    def _restore_engine(self) -> None:
        """On --resume: the engine (restarted, or attached at other weights) serves the last trained weights."""
        if self.model_dir == self.initial_model_dir:
            return
        trained = self.model_dir.parent if self.model_dir.name == "merged" else self.model_dir
        self._push(trained.parent, self.weight_version)

    def _report(self, stats: IterationStats) -> None:
        """An iteration is done: to the tracker (at step = iteration), RUN/report.html (rewritten each time, so a
        browser reload shows the run so far) and the caller's table."""
        from polar_mitm.report.live import refresh_report

        self.tracker.log(stats.tracked_metrics(), step=stats.iteration)
        try:
            refresh_report(self.cfg.run_dir, stats.to_json())
        except Exception:  # a page that cannot be drawn must not stop a long run: the next iteration retries
            logger.warning("RUN/report.html not rewritten after iteration %d", stats.iteration, exc_info=True)
        self.on_iteration(stats)

    def _close_ray_pool(self) -> None:
        if self.ray_pool is not None:
            self.ray_pool.close()  # stops the node actors (their gateways were stopped after each rollout)


def rewarded_summary(path: Path, tasks: dict[str, Task], info: dict[str, Any]) -> RolloutSummary:
    """A finished rollout back from its rewards file (and its marker's figures)."""
    import pyarrow.parquet as pq

    from polar_mitm.loop.informative import SampledRolloutSummary

    sessions = [session_from_row(row, tasks) for row in pq.read_table(path).to_pylist()]
    return SampledRolloutSummary(
        sessions, info["seconds"], 0.0, replaced_groups=info.get("replaced_groups", 0)
    )


def set_aside(flows: Path) -> None:
    """Records of a rollout that runs again whole go beside it (`flows.interrupted-N`), never merged."""
    if not flows.exists():
        return
    n = len(list(flows.parent.glob(f"{flows.name}.interrupted-*")))
    flows.rename(flows.with_name(f"{flows.name}.interrupted-{n}"))


class RolloutsAhead:
    """--overlap N: a thread rolls out and merges the iterations in order, each once the trainer has finished all
    but N of the trainings before it (so its data is at most N weight versions old when it is trained on)."""

    def __init__(self, loop: Loop, start: int, overlap: int) -> None:
        self.loop, self.start = loop, start
        self.permits = threading.Semaphore(overlap + 1)  # rollout r may start once training r-1-N is done
        self.ready: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._produce, name="polar-rollouts", daemon=True)

    def __enter__(self) -> RolloutsAhead:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopping.set()
        self.permits.release()  # a producer waiting for a permit sees the stop
        self.thread.join()  # a rollout under way finishes first (its harnesses must not outlive the loop)

    def _produce(self) -> None:
        try:
            for k in range(self.start, self.loop.cfg.iterations):
                self.permits.acquire()
                if self.stopping.is_set():
                    return
                rolled = self.loop._rollout_stage(k)
                self.ready.put((rolled, self.loop._merge_stage(k, rolled[1], rolled[2]), None))
        except BaseException as exc:  # surfaced in the trainer's thread, at its next get()
            self.ready.put((None, None, exc))

    def get(self, k: int) -> tuple[tuple, tuple[MergeFigures, float]]:
        """Iteration k's rollout and merge (waiting for them)."""
        rolled, merged, error = self.ready.get()
        if error is not None:
            raise error
        return rolled, merged

    def trained(self) -> None:
        self.permits.release()
