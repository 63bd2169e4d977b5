"""`polar-mitm loop`: rollout → merge → GRPO → push weights → repeat.

Each iteration: a gateway writes the iteration's records to `RUN/iter-K/flows`, G harness sessions per task run
through it (the staged rollout), `merge` joins the records into sequences with the rewards, GRPO trains on them,
and the new weights are pushed to the engine (`/update_weights_from_disk`), whose `weight_version` then appears in
the next iteration's records.

`--overlap 1` runs iteration K+1's rollouts while the trainer trains on iteration K (Polar's asynchronous design):
those rollouts are one weight version behind, which the trainer's importance ratios against the recorded behaviour
logprobs correct for (staleness is reported in the metrics).
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_mitm import engines, procs
from polar_mitm.reconstruct.builders import BuilderName
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.progress import LoopProgress, NoProgress, trainer_progress_callback
from polar_mitm.rollout.runner import Rollout, RolloutConfig, RolloutSummary, write_rewards
from polar_mitm.rollout.tasks import Task, load_tasks

if TYPE_CHECKING:
    from polar_mitm.rollout.ray_driver import RayPool


def _help(text: str) -> dict[str, str]:
    return {"help": text}


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
        default=False, metadata=_help("Train LoRA adapters (merged copy pushed to the engine).")
    )
    loss_type: str = "dapo"  # not an option: `polar-mitm grpo --loss-type` names them
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

    def to_json(self) -> dict[str, Any]:
        return self.__dict__


def reward_stats(summary: RolloutSummary) -> tuple[float, float, float]:
    rewards = [s.reward for s in summary.sessions if s.reward is not None]
    if not rewards:
        return 0.0, 0.0, 0.0
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return mean, std, sum(r > 0 for r in rewards) / len(rewards)


class Loop:
    """Owns the engine for the whole run; a fresh gateway (and record directory) per iteration."""

    def __init__(self, cfg: LoopConfig, on_iteration=None, progress: LoopProgress | None = None) -> None:
        self.cfg = cfg
        self.tasks: list[Task] = load_tasks(cfg.tasks)
        self.on_iteration = on_iteration or (lambda stats: None)
        self.progress: LoopProgress = progress or NoProgress()
        self.model_dir: Path | None = None
        self.weight_version = "0"  # of self.model_dir, as the engine numbers it
        self.engine_url = cfg.engine_url
        self.ray_pool: RayPool | None = None  # with --ray: the node actors, kept for the whole run

    # -- stages --------------------------------------------------------------------------------------------------

    def _gateway_options(self) -> dict[str, str]:
        """Every gateway of the run forces the training temperature and the completion budget."""
        return {
            "polar_temperature": str(self.cfg.temperature),
            "polar_max_tokens": str(self.cfg.max_tokens),
            **engines.gateway_options(self.engine_url),
        }

    def _rollout(self, k: int) -> tuple[RolloutSummary, Path, Path, float]:
        if self.cfg.ray_address is not None:
            return self._ray_rollout(k)  # one gateway per node, records under iter-K/flows/node-*/
        cfg, it = self.cfg, self.cfg.run_dir / f"iter-{k}"
        started = time.monotonic()
        it.mkdir(parents=True, exist_ok=True)
        self.progress.stage(k, "rollout", len(self.tasks) * cfg.group_size)
        # Stopping the gateway compacts its journal: the iteration's records are complete shards after the block.
        with procs.gateway_running(
            engines.gateway_backends(self.engine_url, 1)[0],
            it / "flows",
            confdir=cfg.run_dir / "mitmproxy",
            log=it / "gateway.log",
            options=self._gateway_options(),
        ) as gw:
            rollout = Rollout(
                self.tasks,
                HarnessSpec(cfg.harness),
                GatewayEndpoints(gw.reverse_url, gw.proxy_url, gw.ca_bundle()),
                RolloutConfig(
                    group_size=cfg.group_size,
                    concurrency=cfg.concurrency,
                    keep=cfg.keep,
                    workspace_root=it / "workspaces",
                    log_dir=it / "logs",
                ),
            )
            rollout.on_update = lambda sessions: self.progress.advance(
                sum(s.stage == "done" for s in sessions)
            )
            import asyncio

            summary = asyncio.run(rollout.run())
        write_rewards(summary, it / "rewards.parquet")
        return summary, it / "flows", it / "rewards.parquet", time.monotonic() - started

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

    def _train(self, k: int) -> tuple[Path, str | None, float]:
        import torch

        from polar_mitm.train.data import build_training_data, load_sequences
        from polar_mitm.train.grpo_config import PolarGRPOConfig
        from polar_mitm.train.grpo_trainer import PolarGRPOTrainer
        from polar_mitm.train.sync import attach_engine_push

        cfg, it = self.cfg, self.cfg.run_dir / f"iter-{k}"
        started = time.monotonic()
        self.progress.stage(k, "train")
        if cfg.train_processes > 1:
            saved_dir, version = train_in_processes(
                cfg, self.model_dir, it, self.engine_url, self.weight_version
            )
            return saved_dir, version, time.monotonic() - started
        data = build_training_data(load_sequences([it / "merged"]))
        out = it / "train"
        config = PolarGRPOConfig(
            output_dir=str(out),
            num_train_epochs=cfg.epochs,
            learning_rate=cfg.learning_rate,
            per_device_train_batch_size=cfg.per_device_batch_size,
            temperature=cfg.temperature,
            loss_type=cfg.loss_type,
            push_to_engine=self.engine_url,
            report_to=[],
            seed=cfg.seed,
            lr_scheduler_type="constant",
            save_merged=True,
            disable_tqdm=True,
            dataloader_pin_memory=torch.cuda.is_available(),  # pinned memory needs an accelerator (else a warning)
            # The weights we start from, not "the newest in the data": with --overlap the data is one version behind,
            # and staleness (hence the importance correction) is measured against this.
            policy_weight_version=self.weight_version,
        )
        peft_config = None
        if cfg.lora:
            from peft import LoraConfig

            peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
        trainer = PolarGRPOTrainer(str(self.model_dir), args=config, train_data=data, peft_config=peft_config)
        attach_engine_push(trainer)
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(
            PrinterCallback
        )  # the loop prints its own table; metrics.jsonl has every step
        trainer.add_callback(trainer_progress_callback(self.progress))
        trainer.train()
        saved = trainer.save_final()
        version = trainer.policy_weight_version()
        (it / "data_stats.json").write_text(json.dumps(data.stats.to_dict(), indent=2))
        return (
            saved.get("merged", saved["model"]) if cfg.lora else saved["model"],
            version,
            time.monotonic() - started,
        )

    def _final_rollout(self, k: int) -> IterationStats:
        """Rollout + merge with the last pushed weights, no training: the reward the trained policy earns."""
        summary, flows, rewards, rollout_s = self._rollout(k)
        merged, merge_s = self._merge(k, flows, rewards)  # kept for `polar-mitm report` and `show`
        mean, std, pass_rate = reward_stats(summary)
        return IterationStats(
            iteration=k,
            weight_version=self.weight_version,
            sessions=len(summary.sessions),
            reward_mean=mean,
            reward_std=std,
            pass_rate=pass_rate,
            sequences=merged.sequences,
            requests=merged.trainable_records,
            trainable_tokens=merged.trainable_tokens,
            total_tokens=merged.total_tokens,
            seconds={"rollout": rollout_s, "merge": merge_s, "train": 0.0},
        )

    # -- driver --------------------------------------------------------------------------------------------------

    def run(self) -> list[IterationStats]:
        from polar_mitm.engine.model_zoo import resolve_model

        cfg = self.cfg
        cfg.run_dir = cfg.run_dir.resolve()
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.model_dir = resolve_model(cfg.model, seed=cfg.seed)
        with ExitStack() as running:
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
                mean, std, pass_rate = reward_stats(summary)
                stats = IterationStats(
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
                    seconds={"rollout": rollout_s, "merge": merge_s, "train": train_s},
                )
                results.append(stats)
                self.on_iteration(stats)
                if k + 1 < cfg.iterations:
                    pending = next_rollout.get("result") or self._rollout(k + 1)
            if cfg.final_rollout:
                results.append(self._final_rollout(cfg.iterations))
                self.on_iteration(results[-1])
            (cfg.run_dir / "loop.json").write_text(json.dumps([r.to_json() for r in results], indent=2))
        return results

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
    cfg: LoopConfig, model_dir: Path, it: Path, engine_url: str, weight_version: str | None
) -> tuple[Path, str | None]:
    """One GRPO step as `cfg.train_processes` processes running `polar-mitm grpo`; returns (weights, version)."""
    import os
    import subprocess

    n = cfg.train_processes
    if cfg.per_device_batch_size % n:
        raise ValueError(
            f"--batch-size {cfg.per_device_batch_size} must be divisible by --train-processes {n} "
            f"(the global batch stays the same)"
        )
    out = it / "train"
    launcher, env = train_launcher(n)
    argv = [
        *launcher,
        "polar_mitm.cli",
        "grpo",
        "--data",
        str(it / "merged"),
        "--model",
        str(model_dir),
        "-o",
        str(out),
        "--epochs",
        str(cfg.epochs),
        "--learning-rate",
        str(cfg.learning_rate),
        "--lr-scheduler",
        "constant",
        "--per-device-batch-size",
        str(cfg.per_device_batch_size // n),
        "--temperature",
        str(cfg.temperature),
        "--loss-type",
        cfg.loss_type,
        "--seed",
        str(cfg.seed),
        "--push-to-engine",
        engine_url,
        "--report-to",
        "none",
    ]
    if weight_version is not None:
        argv += ["--policy-weight-version", weight_version]
    if cfg.lora:
        argv += ["--lora", "--save-merged"]
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
