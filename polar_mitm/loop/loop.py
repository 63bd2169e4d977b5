"""`polar-mitm loop`: rollout → merge → GRPO → push weights → repeat.

Each iteration: the run's gateway (up for the whole run, gateways.py) writes the iteration's records to
`RUN/iter-K/flows`, G harness sessions per task run through it (the staged rollout, rollouts.py), `merge` joins the
records into sequences with the rewards, GRPO trains on them (training.py), and the new weights are pushed to the
engine (`/update_weights_from_disk`), whose `weight_version` then appears in the next iteration's records. Each
stage hands the next a typed result (stages.py).

`--overlap N` rolls out up to N iterations ahead of the trainer (Polar's asynchronous design, overlap.py): a thread
runs the rollouts (and merges) in order, iteration K+N's while iteration K trains, so their data is up to N weight
versions behind; the trainer's importance ratios against the recorded behaviour logprobs correct for it, and every
call's staleness (its record's weight_version against the weights being trained) is in the trainer's metrics. A
push lands while sessions are mid-flight: their later calls carry the new version, and each call is corrected by its
own.

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
import shutil
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from polar_mitm.engines import processes as engine_processes
from polar_mitm.engines import router, weights
from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.evaluation import EvalResult, check_held_out, eval_due
from polar_mitm.loop.figures import (
    IterationStats,
    MergeFigures,
    call_staleness,
    eval_metrics,
    iteration_stats,
    stats_from_json,
    token_staleness,
    training_fractions,
)
from polar_mitm.loop.overlap import RolloutsAhead
from polar_mitm.loop.progress import LoopProgress, NoProgress
from polar_mitm.loop.rollouts import LoopRollouts, set_aside
from polar_mitm.loop.run_state import (
    IterationState,
    SessionJournal,
    append_event,
    config_differences,
    in_run_dir,
    prune_checkpoints,
    record_run,
    recorded_run_dir,
    stored_path,
    write_json_atomic,
)
from polar_mitm.loop.service_rollouts import (
    LoopService,
    ServiceSettings,
    check_service,
    merge_results,
    run_tag,
)
from polar_mitm.loop.stages import IterationData, MergeOutcome, RolloutOutcome, TrainedModel
from polar_mitm.loop.trackers import (
    TENSORBOARD_DIR,
    NoTracker,
    Tracker,
    check_tracker,
    log_training_metrics,
    open_tracker,
)
from polar_mitm.loop.training import IterationTraining
from polar_mitm.reconstruct.builders import BuilderName
from polar_mitm.storage.location import private_dir
from polar_mitm.storage.run_layout import (
    ENGINE_WEIGHTS_DIR,
    EVENTS_FILE,
    LOOP_FILE,
    RUN_STATE_DIR,
    SERVICE_RESULTS_FILE,
    START_EVAL_DIR,
    TRAIN_DIR,
    iteration_dir,
)
from polar_mitm.tasks.task_file import Task, load_tasks
from polar_mitm.train.learning_rate import default_learning_rate

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
        check_service(cfg)
        check_tracker(cfg.report_to)  # refused before the engine starts
        self.tracker: Tracker = NoTracker()  # run() opens the --report-to one
        self.on_iteration = on_iteration or (lambda stats: None)
        self.on_note = logger.info  # a line worth saying (a default chosen for the user); the CLI prints it
        self.progress: LoopProgress = progress or NoProgress()
        self.trainer_callbacks = list(trainer_callbacks or [])
        self.initial_model_dir: Path | None = None  # the run's starting model: LoRA's base, the KL reference
        self.model_dir: Path | None = None  # the newest weights (the next training starts from them)
        self.weight_version = "0"  # of self.model_dir, as the engine numbers it
        self.engine_url = cfg.engine_url
        self._rollouts: LoopRollouts | None = None  # run() starts them once the engine is attached
        self.service: LoopService | None = (
            None  # --service: the rollout service (and, through it, the engine)
        )
        self._states: dict[int, IterationState] = {}  # iter-K/state.json, one writer object per iteration
        self._states_lock = threading.Lock()
        # Where the run was started (run() sets it, _resumed takes it from run.json): paths its files hold that
        # point there are read under cfg.run_dir, so a copied or moved run resumes where it is.
        self.recorded_run_dir = cfg.run_dir

    # -- driver --------------------------------------------------------------------------------------------------

    def run(self) -> list[IterationStats]:
        from polar_mitm.engine.model_zoo import resolve_model

        cfg = self.cfg
        cfg.run_dir = cfg.run_dir.resolve()
        self.recorded_run_dir = cfg.run_dir
        private_dir(cfg.run_dir)  # owner-only: records, rewards, the run state (issue 36 item 2)
        self.model_dir = self.initial_model_dir = resolve_model(cfg.model, seed=cfg.seed)
        if cfg.learning_rate is None:  # by model kind; recorded in run.json, so a resume keeps it
            cfg.learning_rate, said = default_learning_rate(self.initial_model_dir)
            self.on_note(said)
        # --service: checked to answer, and to sample as this loop trains, before the run folder is written
        service = self._checked_service() if cfg.service_url is not None else None
        results = self._resumed() if cfg.resume else self._started()
        with ExitStack() as running:
            # --resume continues the same tracked run (TensorBoard's directory, MLflow's and W&B's run ids in RUN/)
            self.tracker = open_tracker(cfg.report_to, cfg.run_dir, resume=cfg.resume)
            running.callback(self.tracker.close)  # last: after the final figures
            self._replay_tracked(results)
            if service is not None:
                self._rollouts = running.enter_context(self._service_rollouts(*service))
            else:
                self._attach_engine(running)
            self._restore_engine()
            self.start_eval = self._start_eval_stage()
            self._iterate(results)
            if cfg.final_rollout and len(results) == cfg.iterations:
                self._done(self._final_rollout(cfg.iterations), results)
            write_json_atomic(cfg.run_dir / LOOP_FILE, [r.to_json() for r in results])
            append_event(cfg.run_dir, "finished", len(results) - 1, None, weight_version=self.weight_version)
        return results

    def _attach_engine(self, running: ExitStack) -> None:
        """The run's engine (ours, or the one given) and the rollouts' gateways in front of it, up until `running`
        closes."""
        cfg = self.cfg
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
        # Closed before the engine goes: the node actors stop their gateways, the gateways compact their journals.
        self._rollouts = running.enter_context(
            LoopRollouts(cfg, self.tasks, self.eval_tasks, self.progress, self.engine_url)
        )
        if cfg.engine_url is not None and self.model_dir == self.initial_model_dir:  # nothing trained yet
            self.weight_version = weights.common_weight_version(self.engine_url) or "0"

    def _checked_service(self) -> tuple[LoopService, dict]:
        """The rollout service and its health, once it answers and samples as this loop trains."""
        cfg = self.cfg
        assert cfg.service_url is not None
        builder = BuilderName(cfg.builder).value
        service = LoopService(cfg.service_url, cfg.harness, builder, run_tag(cfg.run_dir))
        try:
            return service, service.check(ServiceSettings(cfg.temperature, cfg.max_tokens))
        except BaseException:
            service.close()
            raise

    def _service_rollouts(self, service: LoopService, health: dict) -> LoopRollouts:
        """`--service`: the rollouts on the service, whose engine this run trains; no engine or gateway of ours."""
        rollouts = LoopRollouts(self.cfg, self.tasks, self.eval_tasks, self.progress, None)
        rollouts.service = self.service = service
        if self.model_dir == self.initial_model_dir:  # nothing trained yet: the version it serves now
            self.weight_version = health.get("weight_version") or "0"
        return rollouts

    @property
    def rollouts(self) -> LoopRollouts:
        """The run's rollouts and evaluations (rollouts.py), up while run() has the engine."""
        assert self._rollouts is not None, "run() starts the rollouts once the engine is attached"
        return self._rollouts

    def _iterate(self, results: list[IterationStats]) -> None:
        """The iterations not done yet: in turn, or (--overlap N) with rollouts up to N iterations ahead."""
        cfg, start = self.cfg, len(results)
        if cfg.overlap < 1:
            for k in range(start, cfg.iterations):
                self._done(self._iteration(k, self._prepared(k)), results)
            return
        with RolloutsAhead(self._prepared, range(start, cfg.iterations), cfg.overlap) as ahead:
            for k in range(start, cfg.iterations):
                self._done(self._iteration(k, ahead.get(k)), results)
                ahead.trained()

    def _prepared(self, k: int) -> IterationData:
        """Iteration k's rollout and merge: what its training needs (in the overlap thread with --overlap)."""
        rolled = self._rollout_stage(k)
        return IterationData(rolled, self._merge_stage(k, rolled))

    def _iteration(self, k: int, data: IterationData) -> IterationStats:
        """Iteration k after its rollout and merge: train, push, evaluate; its figures."""
        trained = self._train_stage(k)
        self.model_dir = trained.model_dir
        self.weight_version = trained.weight_version or self.weight_version
        seconds = {"rollout": data.rollout.seconds, "merge": data.merge.seconds, "train": trained.seconds}
        stats = iteration_stats(k, trained.weight_version, data.rollout.summary, data.merge.figures, seconds)
        stats.call_staleness = call_staleness(iteration_dir(self.cfg.run_dir, k), trained.base_weight_version)
        stats.token_staleness = token_staleness(
            iteration_dir(self.cfg.run_dir, k), trained.base_weight_version
        )
        stats.push = trained.push
        stats.train_skipped = trained.skipped
        if (
            not trained.skipped
        ):  # how much the trust region acted: PPO's clip, and the TIS cap on stale tokens
            fractions = training_fractions(iteration_dir(self.cfg.run_dir, k) / TRAIN_DIR / "metrics.jsonl")
            stats.clip_fraction, stats.tis_capped_fraction = (
                fractions["clip_fraction"],
                fractions["tis_capped_fraction"],
            )
        stats.eval = self._eval_stage(k)
        return stats

    def _final_rollout(self, k: int) -> IterationStats:
        """Rollout + merge with the last pushed weights, no training: the reward the trained policy earns."""
        data = self._prepared(k)  # the merge kept for `polar-mitm report` and `show`
        seconds = {"rollout": data.rollout.seconds, "merge": data.merge.seconds, "train": 0.0}
        return iteration_stats(k, self.weight_version, data.rollout.summary, data.merge.figures, seconds)

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

    # -- resumable stages (iter-K/state.json: run_state.py) ---------------------------------------------------

    def _in_run(self, stored: str) -> Path:
        """A path a stage marker holds, in the run directory as it is now (run_state.in_run_dir)."""
        return in_run_dir(stored, self.cfg.run_dir, self.recorded_run_dir)

    def _state(self, k: int) -> IterationState:
        with self._states_lock:
            if k not in self._states:
                self._states[k] = IterationState(iteration_dir(self.cfg.run_dir, k), k)
            return self._states[k]

    def _rollout_stage(self, k: int) -> RolloutOutcome:
        """Iteration k's rollout: done before (its rewards file), finished in part (the journalled sessions kept,
        the rest run now), or run whole."""
        it, state = iteration_dir(self.cfg.run_dir, k), self._state(k)
        if state.done("rollout"):
            return self.rollouts.recorded(k, state.info("rollout"))
        state.begin("rollout")
        finished = SessionJournal(it).rows()
        if finished and self.cfg.ray_address is None:
            rolled = self.rollouts.rerun_unfinished(k, finished)
        else:
            # Nothing finished to keep (or --ray, whose node records are not journalled): the rollout runs whole,
            # the records of an attempt a kill interrupted set aside.
            set_aside(it / "flows")
            rolled = self.rollouts.iteration(k)
        state.finish(
            "rollout",
            seconds=rolled.seconds,
            sessions=len(rolled.summary.sessions),
            kept_sessions=len(finished),
            replaced_groups=getattr(rolled.summary, "replaced_groups", 0),
        )
        return rolled

    def _merge_stage(self, k: int, rolled: RolloutOutcome) -> MergeOutcome:
        state = self._state(k)
        if not state.done("merge"):
            state.begin("merge")
            merged = self._merge(k, rolled)
            state.finish("merge", figures=asdict(merged.figures), seconds=merged.seconds)
        info = state.info("merge")
        return MergeOutcome(MergeFigures(**info["figures"]), info["seconds"])

    def _merge(self, k: int, rolled: RolloutOutcome) -> MergeOutcome:
        from polar_mitm.reconstruct.merge import merge

        started = time.monotonic()
        self.progress.stage(k, "merge")
        it = iteration_dir(self.cfg.run_dir, k)
        merged = it / "merged"
        shutil.rmtree(merged, ignore_errors=True)  # what a merge a kill interrupted left
        if (it / SERVICE_RESULTS_FILE).exists():  # --service: the traces it answered are the merged rows
            summary = merge_results(it, merged, BuilderName(self.cfg.builder).value, self.cfg.end_rules())
            return MergeOutcome(MergeFigures.of(summary), time.monotonic() - started)
        summary = merge(
            [str(rolled.flows)],
            str(merged),
            builder=self.cfg.builder,
            rewards=str(rolled.rewards),
            # The run's tokenizer never changes; the initial model's copy is never pruned or written to.
            tokenizer=str(self.initial_model_dir),
            # Sessions a killed rollout left unfinished have records but no reward: never trained on.
            drop_unrewarded=True,
            end_rules=self.cfg.end_rules(),  # --on-*: what each way a session ended does to its reward
        )
        return MergeOutcome(MergeFigures.of(summary), time.monotonic() - started)

    def _train_stage(self, k: int) -> TrainedModel:
        """Iteration k's training (unless done: its marker, or a training that saved all before a kill) and the push
        of its weights."""
        it, state = iteration_dir(self.cfg.run_dir, k), self._state(k)
        if not state.done("train"):
            state.begin("train")
            trained = self._training(k).run()
            state.finish(
                "train",
                model_dir=stored_path(trained.model_dir, self.cfg.run_dir),
                weight_version=trained.weight_version,
                seconds=trained.seconds,
                # what the training started from (staleness is measured against it)
                base_weight_version=self.weight_version,
                skipped=trained.skipped,
            )
        info = state.info("train")
        if not state.done("push"):
            state.begin("push")
            pushed = None if info.get("skipped") else self._push(it, info["weight_version"])
            state.finish("push", weight_version=info["weight_version"], report=pushed)
        return TrainedModel(
            self._in_run(info["model_dir"]),
            info["weight_version"],
            info["seconds"],
            skipped=bool(info.get("skipped")),
            base_weight_version=info.get("base_weight_version"),
            push=state.info("push").get("report"),
        )

    def _training(self, k: int) -> IterationTraining:
        """Iteration k's training from the weights the loop has now (training.py)."""
        assert self.model_dir is not None and self.initial_model_dir is not None, "run() resolves the model"
        return IterationTraining(
            cfg=self.cfg,
            iteration=k,
            initial_model_dir=self.initial_model_dir,
            model_dir=self.model_dir,
            weight_version=self.weight_version,
            engine_url=self.engine_url,
            tracker=self.tracker,
            progress=self.progress,
            trainer_callbacks=self.trainer_callbacks,
            recorded_run_dir=self.recorded_run_dir,
        )

    def _push(self, it: Path, version: str | None) -> dict[str, Any] | None:
        """The engine serves `version` (the trained weights of `it`) after this: pushed unless it already does.
        What the push did (PushReport's fields: the pause running sessions saw, the mode), or None: no push."""
        if self.service is not None and version is not None:  # --service: through it, to its engine
            if self.service.weight_version() != version:
                return self.service.push(it / "train" / ENGINE_WEIGHTS_DIR, version)
            return None
        if version is None or self.engine_url is None:  # no engine: a training driven alone (tests)
            return None
        if weights.common_weight_version(self.engine_url) == version:
            return None
        folder = it / "train" / ENGINE_WEIGHTS_DIR
        return weights.push_weights_reported(self.engine_url, folder, weight_version=version).as_json()

    def _eval_stage(self, k: int) -> EvalResult | None:
        cfg, state = self.cfg, self._state(k)
        if not (self.eval_tasks and eval_due(k, cfg.eval_every, cfg.iterations)):
            return None
        if not state.done("eval"):
            state.begin("eval")
            # An evaluation a kill interrupted runs again whole (its records are never trained on).
            shutil.rmtree(cfg.run_dir / f"eval-{k}", ignore_errors=True)
            result = self.rollouts.evaluate(k, self.weight_version)
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
            result = self.rollouts.evaluate(-1, self.weight_version, it)
            append_event(cfg.run_dir, "eval_done", -1, "eval", pass_at=result.pass_at)
        result = EvalResult(**json.loads((it / "eval.json").read_text()))
        self.tracker.log(eval_metrics(result), step=-1)
        return result

    # -- a run started, resumed, reported ------------------------------------------------------------------------

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
        assert self.model_dir is not None
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
