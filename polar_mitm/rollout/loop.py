"""`polar-mitm loop`: rollout → merge → GRPO → push weights → repeat.

Each iteration: a gateway writes the iteration's records to `RUN/iter-K/flows`, G harness sessions per task run
through it (the staged rollout), `merge` joins the records into sequences with the rewards, GRPO trains on them,
and the new weights are pushed to the engine (`/update_weights_from_disk`), whose `weight_version` then appears in
the next iteration's records.

`--overlap 1` runs iteration K+1's rollouts while the trainer trains on iteration K (Polar's asynchronous design):
those rollouts are one weight version behind, which the trainer's importance ratios against the recorded behaviour
logprobs correct for (staleness is reported in the metrics).

The iterations share one optimizer: each training continues the AdamW state, the LR schedule (spanning all
iterations) and the step count of the one before (`RUN/trainer-state`, see train/continuation.py), whether it runs
in this process or as `--train-processes` processes, and the KL reference stays the run's initial model. Every
`polar-mitm grpo` option is a loop option too (rollout/cli.py's `loop_trainer_options`), but for the few the loop
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_mitm import engines, procs
from polar_mitm.reconstruct.builders import BuilderName
from polar_mitm.rollout.evaluation import EvalResult, check_held_out, eval_due, evaluation_result
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.informative import (
    GroupSampler,
    check_dynamic_sampling,
    group_figures,
    group_sampler,
    sample_groups,
)
from polar_mitm.rollout.progress import LoopProgress, NoProgress, trainer_progress_callback
from polar_mitm.rollout.runner import Rollout, RolloutConfig, RolloutSummary, write_rewards
from polar_mitm.rollout.tasks import Task, load_tasks
from polar_mitm.rollout.trackers import (
    TENSORBOARD_DIR,
    NoTracker,
    Tracker,
    check_tracker,
    log_training_metrics,
    numeric_metrics,
    open_tracker,
)
from polar_mitm.train.cli import LORA_HELP

if TYPE_CHECKING:
    from polar_mitm.rollout.ray_driver import RayPool

logger = logging.getLogger(__name__)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


RUN_STATE_DIR = "trainer-state"  # under the run directory: the optimizer carried across iterations

# PolarGRPOConfig fields the loop sets itself, so `polar-mitm loop` has no option of that name: the loop's own
# option for the same setting (LoopConfig), or what each iteration's training must be told.
LOOP_SETS: dict[str, str] = {
    "learning_rate": "--learning-rate",
    "per_device_train_batch_size": "--batch-size",
    "num_train_epochs": "--epochs",
    "temperature": "--temperature (the gateway samples at it)",
    "seed": "the loop's seed",
    "group_size": "--group-size",
    "push_to_engine": "the loop's engine",
    "policy_weight_version": "the version the engine serves",
    "run_state_dir": f"RUN/{RUN_STATE_DIR}",
    "lr_schedule_trainings": "--iterations",
    "save_merged": "always, with --lora (the merged copy is pushed)",
    "resume_from_checkpoint": "each iteration is a new training",
}
# Where a loop option's default differs from `polar-mitm grpo`'s: the loop's LR stays constant unless asked.
LOOP_TRAINER_DEFAULTS: dict[str, Any] = {"lr_scheduler_type": "constant"}


@dataclass
class LoopConfig:
    """The RL loop's settings; each field with a `help` is a `polar-mitm loop` option (rollout/cli.py)."""

    tasks: Path = field(metadata=_help("Task file (JSONL)."))
    run_dir: Path = field(metadata=_help("Everything of the run goes here."))
    harness: str = field(
        default="sdk:openai_chat", metadata=_help("sdk:PROVIDER | cmd:TEMPLATE | preset name.")
    )
    iterations: int = field(default=2, metadata=_help("RL iterations."))
    group_size: int = field(default=4, metadata=_help("Sessions per task (G)."))
    concurrency: int = field(default=4, metadata=_help("Harness sessions at once."))
    model: str = field(default="tiny", metadata=_help("Starting model: tiny | smollm2 | PATH."))
    script: Path | None = field(default=None, metadata=_help("Scripted policy for the embedded engine."))
    engine_url: str | None = field(
        default=None, metadata=_help("Attach to this engine (SGLang) instead of starting one.")
    )
    temperature: float = field(
        default=1.0, metadata=_help("Sampling temperature (forced) = training temperature.")
    )
    max_tokens: int = field(default=256, metadata=_help("Completion budget per model call."))
    learning_rate: float = field(default=5e-3, metadata=_help("Learning rate."))
    per_device_batch_size: int = field(default=4, metadata=_help("Sequences per training micro-batch."))
    epochs: float = field(default=1.0, metadata=_help("Passes over each iteration's sequences."))
    lora: bool = field(
        default=False,
        metadata=_help(
            "Train LoRA adapters on the initial model, carried across iterations (merged copy pushed to the "
            "engine)."
        ),
    )
    lora_r: int = field(default=16, metadata=_help(LORA_HELP["lora_r"]))
    lora_alpha: int = field(default=32, metadata=_help(LORA_HELP["lora_alpha"]))
    lora_target_modules: str = field(default="all-linear", metadata=_help(LORA_HELP["lora_target_modules"]))
    # PolarGRPOConfig fields for every iteration's training, by name (`polar-mitm loop`'s generated trainer options,
    # or set from Python); LOOP_TRAINER_DEFAULTS where absent; the loop's own settings (LOOP_SETS) win.
    grpo: dict[str, Any] = field(default_factory=dict)
    builder: BuilderName = field(
        default=BuilderName.prefix_merging, metadata=_help(BuilderName.__doc__ or "")
    )
    overlap: int = field(default=0, metadata=_help("1: next rollouts run while the trainer trains."))
    keep: int | None = field(
        default=None, metadata=_help("Straggler cut: stop a group once K sessions are done.")
    )
    seed: int = 0  # the trainer's seed and, for `tiny`, the seed of its initial weights
    ray_address: str | None = field(
        default=None,
        metadata=_help("Rollouts on this Ray cluster (auto | HOST:PORT | local), one gateway per node."),
    )
    # the same `polar-mitm grpo` command recipes/training.md describes, launched N times
    train_processes: int = field(
        default=1,
        metadata=_help(
            "GRPO step as N data-parallel processes (accelerate on GPUs, torchrun + gloo on CPU); same "
            "global batch."
        ),
    )
    final_rollout: bool = (
        False  # after the last training, one more rollout (no training): the trained policy's reward
    )
    eval_tasks: Path | None = field(
        default=None,
        metadata=_help(
            "Held-out task file (JSONL, no task id shared with TASKS): evaluated, never trained on."
        ),
    )
    eval_every: int = field(default=1, metadata=_help("Evaluate after every K-th training (and the last)."))
    eval_samples: int = field(default=4, metadata=_help("Sessions per held-out task (N of pass@k, k <= N)."))
    eval_greedy: bool = field(
        default=False, metadata=_help("Evaluate greedily (temperature 0) instead of at --temperature.")
    )
    report_to: str = field(
        default="none",
        metadata=_help(
            "tensorboard | mlflow | wandb | none, or a comma list: the loop's figures, evaluations and the "
            "trainer's per-step metrics in one tracked run, continued by --resume; offline only (TensorBoard: "
            "RUN/tensorboard, MLflow file store: RUN/mlruns, W&B offline: RUN/wandb)."
        ),
    )
    min_informative_groups: int | None = field(
        default=None,
        metadata=_help(
            "Dynamic sampling: each iteration starts with N task groups (a seeded cycle through TASKS); groups "
            "whose rewards are all equal are replaced by groups of tasks not yet run in that iteration, until N "
            "are informative or --resample-budget is spent; the flat ones are not trained on (rollout/"
            "informative.py)."
        ),
    )
    resample_budget: int | None = field(
        default=None,
        metadata=_help(
            "With --min-informative-groups N: at most M replacement groups per iteration (default: N)."
        ),
    )


@dataclass
class IterationStats:
    iteration: int
    weight_version: str | None
    sessions: int
    reward_mean: float
    reward_std: float
    pass_rate: float
    sequences: int
    requests: int
    trainable_tokens: int
    total_tokens: int
    seconds: dict[str, float] = field(default_factory=dict)
    # --keep: sessions stopped once K of their group were done; no reward, so left out of the group (and of training)
    cut_sessions: int = 0
    # --eval-tasks: the held-out evaluation of the weights this iteration's training produced, when one was due
    eval: EvalResult | None = None
    # task groups rolled out, those with zero advantage (all rewards equal: not trained on), and the groups drawn to
    # replace them (--min-informative-groups; 0 without it)
    groups: int = 0
    uninformative_groups: int = 0
    replaced_groups: int = 0

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "eval": self.eval.to_json() if self.eval else None}

    def tracked_metrics(self) -> dict[str, float]:
        """The figures a tracker gets for this iteration (`loop/…`, `eval/…`)."""
        figures = {
            key: value
            for key, value in self.__dict__.items()
            if key not in ("iteration", "weight_version", "eval")
        }
        metrics = numeric_metrics(figures, "loop")
        if self.eval is not None:
            metrics.update(numeric_metrics(self.eval.pass_at, "eval"))
            metrics["eval/reward_mean"] = self.eval.reward_mean
        return metrics


def cut_sessions(summary: RolloutSummary) -> int:
    """Sessions the straggler cut (--keep) stopped: unevaluated, so without a reward."""
    return sum(s.status == "cut" for s in summary.sessions)


def reward_stats(summary: RolloutSummary) -> tuple[float, float, float]:
    rewards = [s.reward for s in summary.sessions if s.reward is not None]
    if not rewards:
        return 0.0, 0.0, 0.0
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return mean, std, sum(r > 0 for r in rewards) / len(rewards)


def iteration_stats(
    k: int, version: str | None, summary: RolloutSummary, merged: Any, seconds: dict[str, float]
) -> IterationStats:
    """Iteration k's figures from its rollout and merge summaries."""
    mean, std, pass_rate = reward_stats(summary)
    return IterationStats(
        iteration=k,
        weight_version=version,
        sessions=len(summary.sessions),
        reward_mean=mean,
        reward_std=std,
        pass_rate=pass_rate,
        sequences=merged.sequences,
        requests=merged.trainable_records,
        trainable_tokens=merged.trainable_tokens,
        total_tokens=merged.total_tokens,
        seconds=seconds,
        cut_sessions=cut_sessions(summary),
        **group_figures(summary),
    )


class Loop:
    """Owns the engine for the whole run; a fresh gateway (and record directory) per iteration.

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
        if cfg.eval_tasks:
            check_held_out(self.tasks, self.eval_tasks)
            if cfg.eval_every < 1 or cfg.eval_samples < 1:
                raise ValueError("--eval-every and --eval-samples must be at least 1")
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

    # -- stages --------------------------------------------------------------------------------------------------

    def _gateway_options(self, temperature: float | None = None) -> dict[str, str]:
        """Every gateway of the run forces the training temperature (or the evaluation's) and the completion
        budget."""
        return {
            "polar_temperature": str(self.cfg.temperature if temperature is None else temperature),
            "polar_max_tokens": str(self.cfg.max_tokens),
            **engines.gateway_options(self.engine_url),
        }

    def _rollout(self, k: int) -> tuple[RolloutSummary, Path, Path, float]:
        check_dynamic_sampling(self.cfg)
        if self.cfg.ray_address is not None:
            return self._ray_rollout(k)  # one gateway per node, records under iter-K/flows/node-*/
        started = time.monotonic()
        it = self.cfg.run_dir / f"iter-{k}"
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
            summary = await rollout.run()
            finished_before[0] += len(summary.sessions)
            return summary

        # Stopping the gateway compacts its journal: the iteration's records are complete shards after the block.
        with procs.gateway_running(
            engines.gateway_backends(self.engine_url, 1)[0],
            it / "flows",
            confdir=cfg.run_dir / "mitmproxy",
            log=it / "gateway.log",
            options=gateway_options,
        ) as gw:
            endpoints = GatewayEndpoints(gw.reverse_url, gw.proxy_url, gw.ca_bundle())
            if sampler is None:
                return asyncio.run(run_wave(tasks))
            return asyncio.run(sample_groups(sampler, run_wave))

    def _evaluate(self, k: int) -> EvalResult:
        """The served weights on the held-out tasks: records and rewards under RUN/eval-K, which no merge reads
        (the loop merges only iter-K/flows)."""
        cfg, it = self.cfg, self.cfg.run_dir / f"eval-{k}"
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
        (it / "eval.json").write_text(json.dumps(result.to_json(), indent=2))
        return result

    def _ray_rollout(self, k: int) -> tuple[RolloutSummary, Path, Path, float]:
        """`--ray`: iteration K's rollout on the cluster (the node actors live for the whole run)."""
        from polar_mitm.rollout.ray_driver import RayPool, write_report

        cfg, it = self.cfg, self.cfg.run_dir / f"iter-{k}"
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
        summary = merge(
            [str(flows)],
            str(self.cfg.run_dir / f"iter-{k}" / "merged"),
            builder=self.cfg.builder,
            rewards=str(rewards),
            tokenizer=str(self.model_dir),
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

        from polar_mitm.train.cli import lora_config, training_data
        from polar_mitm.train.data import load_sequences
        from polar_mitm.train.grpo_config import PolarGRPOConfig
        from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
        from polar_mitm.train.sync import attach_engine_push

        cfg, it = self.cfg, self.cfg.run_dir / f"iter-{k}"
        started = time.monotonic()
        self.progress.stage(k, "train")
        fields = self.trainer_fields()
        if cfg.train_processes > 1:
            saved_dir, version = train_in_processes(cfg, self._train_start(), it, fields)
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
        attach_engine_push(trainer)
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(
            PrinterCallback
        )  # the loop prints its own table; metrics.jsonl has every step
        for callback in [trainer_progress_callback(self.progress), *self.trainer_callbacks]:
            trainer.add_callback(callback)
        trainer.train()
        log_training_metrics(self.tracker, it / "train" / "metrics.jsonl")
        saved = trainer.save_final()
        version = trainer.policy_weight_version()
        (it / "data_stats.json").write_text(json.dumps(data.stats.to_dict(), indent=2))
        (it / "train" / "grpo_config.json").write_text(
            config.to_json_string()
        )  # as `polar-mitm grpo` writes it
        return (
            saved.get("merged", saved["model"]) if cfg.lora else saved["model"],
            version,
            time.monotonic() - started,
        )

    def _final_rollout(self, k: int) -> IterationStats:
        """Rollout + merge with the last pushed weights, no training: the reward the trained policy earns."""
        summary, flows, rewards, rollout_s = self._rollout(k)
        merged, merge_s = self._merge(k, flows, rewards)  # kept for `polar-mitm report` and `show`
        seconds = {"rollout": rollout_s, "merge": merge_s, "train": 0.0}
        return iteration_stats(k, self.weight_version, summary, merged, seconds)

    # -- driver --------------------------------------------------------------------------------------------------

    def run(self) -> list[IterationStats]:
        from polar_mitm.engine.model_zoo import resolve_model

        cfg = self.cfg
        cfg.run_dir = cfg.run_dir.resolve()
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.model_dir = self.initial_model_dir = resolve_model(cfg.model, seed=cfg.seed)
        # A new run starts a new optimizer, even in a reused run directory.
        shutil.rmtree(cfg.run_dir / RUN_STATE_DIR, ignore_errors=True)
        shutil.rmtree(cfg.run_dir / TENSORBOARD_DIR, ignore_errors=True)  # and a new tracked run
        with ExitStack() as running:
            self.tracker = open_tracker(cfg.report_to, cfg.run_dir)
            running.callback(self.tracker.close)  # last: after the final figures
            # Ours unless given: the embedded engine; given, one engine, SGLang's router, or a comma list (we start
            # the router).
            engine_url = running.enter_context(
                procs.engine_running(
                    self.engine_url,
                    model=str(self.model_dir),
                    log=cfg.run_dir / "engine.log",
                    extra_args=["--script", str(cfg.script)] if cfg.script else [],
                )
            )
            self.engine_url = running.enter_context(
                engines.attached(engine_url, log=cfg.run_dir / "router.log")
            ).url
            if cfg.engine_url is not None:
                self.weight_version = engines.common_weight_version(self.engine_url) or "0"
            running.callback(self._close_ray_pool)  # first: the node actors stop their gateways
            results: list[IterationStats] = []
            pending = self._rollout(0)
            for k in range(cfg.iterations):
                summary, flows, rewards, rollout_s = pending
                merged, merge_s = self._merge(k, flows, rewards)
                trained: dict[str, Any] = {}
                next_rollout: dict[str, Any] = {}

                def train(k=k, trained=trained) -> None:
                    try:
                        trained["result"] = self._train(k)
                    except BaseException as exc:  # surfaced below, after the overlapping rollout
                        trained["error"] = exc

                if cfg.overlap and k + 1 < cfg.iterations:
                    thread = threading.Thread(target=train, name="polar-trainer")
                    thread.start()
                    next_rollout["result"] = self._rollout(k + 1)  # one weight version behind
                    thread.join()
                else:
                    train()
                if "error" in trained:
                    raise trained["error"]
                self.model_dir, version, train_s = trained["result"]
                self.weight_version = version or self.weight_version
                stats = iteration_stats(
                    k, version, summary, merged, {"rollout": rollout_s, "merge": merge_s, "train": train_s}
                )
                if self.eval_tasks and eval_due(k, cfg.eval_every, cfg.iterations):
                    stats.eval = self._evaluate(k)
                results.append(stats)
                self._report(stats)
                if k + 1 < cfg.iterations:
                    pending = next_rollout.get("result") or self._rollout(k + 1)
            if cfg.final_rollout:
                results.append(self._final_rollout(cfg.iterations))
                self._report(results[-1])
            (cfg.run_dir / "loop.json").write_text(json.dumps([r.to_json() for r in results], indent=2))
        return results

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


def train_in_processes(
    cfg: LoopConfig, start: Path, it: Path, fields: dict[str, Any]
) -> tuple[Path, str | None]:
    """One GRPO step as `cfg.train_processes` processes running `polar-mitm grpo` with the trainer `fields` as its
    options (the same run state, so the optimizer continues as in-process); returns (weights, version)."""
    import os
    import subprocess

    from polar_mitm.train.cli import grpo_argv

    n = cfg.train_processes
    if cfg.per_device_batch_size % n:
        raise ValueError(
            f"--batch-size {cfg.per_device_batch_size} must be divisible by --train-processes {n} "
            f"(the global batch stays the same)"
        )
    out = it / "train"
    launcher, env = train_launcher(n)
    per_process = {**fields, "per_device_train_batch_size": cfg.per_device_batch_size // n}
    argv = [
        *launcher,
        "polar_mitm.cli",
        "grpo",
        *("--data", str(it / "merged"), "--model", str(start), "-o", str(out), "--report-to", "none"),
        *grpo_argv(per_process),
    ]
    if cfg.lora:
        argv += ["--lora", "--lora-r", str(cfg.lora_r), "--lora-alpha", str(cfg.lora_alpha)]
        argv += ["--lora-target-modules", cfg.lora_target_modules]
    log = it / "train.log"
    with open(log, "wb") as sink:
        done = subprocess.run(argv, env={**os.environ, **env}, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the {n}-process GRPO step failed (exit {done.returncode}); log {log}:\n{tail}")
    result = json.loads((out / "result.json").read_text())
    (it / "data_stats.json").write_text((out / "data_stats.json").read_text())
    saved = Path(result.get("merged") or result["model"])
    return saved, result.get("weight_version")
