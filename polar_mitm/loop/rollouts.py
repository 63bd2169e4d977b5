"""How the loop's sessions run: an iteration's rollout (every task, or `--min-informative-groups`' waves), the rest
of one a kill interrupted, a finished one read back, and the held-out evaluations.

Local sessions go through the run's gateways (gateways.py: up from the first rollout to the run's end), each rollout
pointed at its own records folder (`RUN/iter-K/flows`, `RUN/eval-K/flows`) with the training temperature (or the
evaluation's) and the completion budget forced. With `--ray` an iteration's rollout runs on the cluster's node
actors, kept for the whole run, one gateway per node (records under `iter-K/flows/node-*/`). `LoopRollouts` is
entered with the engine attached and closed before it goes: the node actors first, then the gateways, which
compact their journals.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_mitm.engines import router
from polar_mitm.judges.judging import JudgePlaces, judge_sessions
from polar_mitm.loop.config import LoopConfig
from polar_mitm.loop.evaluation import EvalResult, evaluation_result
from polar_mitm.loop.gateways import LoopGateways
from polar_mitm.loop.informative import GroupSampler, check_dynamic_sampling, group_sampler, sample_groups
from polar_mitm.loop.progress import LoopProgress
from polar_mitm.loop.run_state import journal_finished, renumbered, session_from_row, write_json_atomic
from polar_mitm.loop.service_rollouts import LoopService
from polar_mitm.loop.stages import RolloutOutcome
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig, RolloutSummary, SessionRun, write_rewards
from polar_mitm.storage.judgments import JUDGE_CACHE_DIR, JUDGMENTS_DIR
from polar_mitm.storage.run_layout import SERVICE_RESULTS_FILE, iteration_dir
from polar_mitm.tasks.task_file import Task

if TYPE_CHECKING:
    from polar_mitm.rollout.ray_driver import RayPool

log = logging.getLogger(__name__)


class LoopRollouts:
    """The run's rollouts and evaluations against the engine at `engine_url`; the gateways and the Ray pool they
    start live until `close` (or the `with` block's end)."""

    def __init__(
        self,
        cfg: LoopConfig,
        tasks: list[Task],
        eval_tasks: list[Task],
        progress: LoopProgress,
        engine_url: str | None,
    ) -> None:
        self.cfg, self.tasks, self.eval_tasks, self.progress = cfg, tasks, eval_tasks, progress
        self.engine_url = engine_url
        self.tasks_by_id = {t.task_id: t for t in tasks}
        self.service: LoopService | None = None  # with --service: every session runs there
        self.gateways: LoopGateways | None = None  # up from the first local rollout to the run's end
        self.ray_pool: RayPool | None = None  # with --ray: the node actors, kept for the whole run

    def __enter__(self) -> LoopRollouts:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
        try:
            if self.ray_pool is not None:
                self.ray_pool.close()  # stops the node actors (their gateways were stopped after each rollout)
        finally:
            if self.gateways is not None:
                self.gateways.close()  # before the engine goes: the gateways compact their journals

    # -- an iteration's rollout ----------------------------------------------------------------------------------

    def iteration(self, k: int) -> RolloutOutcome:
        """Iteration k's rollout, run whole: G sessions per task (or the dynamic sampler's waves), rewards written."""
        check_dynamic_sampling(self.cfg)
        if self.cfg.ray_address is not None:
            return self._on_ray(k)  # one gateway per node, records under iter-K/flows/node-*/
        started = time.monotonic()
        it = iteration_dir(self.cfg.run_dir, k)
        # --min-informative-groups: N groups, flat ones replaced (informative.py); the final rollout measures all tasks
        sampler = group_sampler(self.cfg, self.tasks, k) if k < self.cfg.iterations else None
        tasks = self.tasks if sampler is None else sampler.first_wave()
        self.progress.stage(k, "rollout", len(tasks) * self.cfg.group_size)
        summary = self._local(it, tasks, self.cfg.group_size, self.gateway_options(), sampler)
        return self._rewarded(it, summary, started)

    def rerun_unfinished(self, k: int, finished: list[dict[str, Any]]) -> RolloutOutcome:
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
        rerun = self._local(it, missing, 1, self.gateway_options()).sessions if missing else []
        summary = RolloutSummary(kept + renumbered(rerun, kept), time.monotonic() - started, 0.0)
        return self._rewarded(it, summary, started)

    def recorded(self, k: int, info: dict[str, Any]) -> RolloutOutcome:
        """Iteration k's finished rollout back from its rewards file and its marker's figures (`info`)."""
        it = iteration_dir(self.cfg.run_dir, k)
        summary = rewarded_summary(it / "rewards.parquet", self.tasks_by_id, info)
        return RolloutOutcome(summary, it / "flows", it / "rewards.parquet", info["seconds"])

    def _planned_tasks(self, k: int, kept: list[SessionRun]) -> list[Task]:
        """The task groups iteration k rolls out: every task (or the dynamic sampler's first wave), and any group a
        kept session belongs to."""
        sampler = group_sampler(self.cfg, self.tasks, k) if k < self.cfg.iterations else None
        planned = self.tasks if sampler is None else sampler.first_wave()
        seen = {t.task_id for t in planned}
        return planned + [
            self.tasks_by_id[i] for i in dict.fromkeys(s.task.task_id for s in kept) if i not in seen
        ]

    def _on_ray(self, k: int) -> RolloutOutcome:
        """`--ray`: iteration K's rollout on the cluster (the node actors live for the whole run)."""
        from polar_mitm.rollout.ray_driver import RayPool, write_report

        cfg, it = self.cfg, iteration_dir(self.cfg.run_dir, k)
        started = time.monotonic()
        it.mkdir(parents=True, exist_ok=True)
        if self.ray_pool is None:
            self.ray_pool = RayPool(cfg.ray_address or "auto", cfg.harness)
        config = RolloutConfig(
            group_size=cfg.group_size,
            concurrency=cfg.concurrency,
            keep=cfg.keep,
            sandbox=cfg.sandbox,
            image=cfg.image,
        )
        result = self.ray_pool.rollout(
            self.tasks,
            config,
            out_dir=it / "flows",
            work_dir=it,
            engine_url=self.engine_url,
            gateway_options=self.gateway_options(),
        )
        if (
            result.interrupted is None
        ):  # judged on the driver: each node's records (flows/node-*), logs (logs/NODE)
            self._judged(it, result.summary)
        write_rewards(result.summary, it / "rewards.parquet", it / "flows")
        write_report(result, it / "ray_report.json")
        if result.interrupted is not None:
            raise KeyboardInterrupt
        return RolloutOutcome(
            result.summary, it / "flows", it / "rewards.parquet", time.monotonic() - started
        )

    def _rewarded(self, it: Path, summary: RolloutSummary, started: float) -> RolloutOutcome:
        """A local rollout's outcome once its sessions are judged and its rewards file is written."""
        self._judged(it, summary)
        write_rewards(summary, it / "rewards.parquet", it / "flows")  # the records say how each session ended
        return RolloutOutcome(summary, it / "flows", it / "rewards.parquet", time.monotonic() - started)

    def _judged(self, it: Path, summary: RolloutSummary) -> None:
        """Tasks with a `judge`: rewards combined with the judge's scores (polar_mitm/judges/); the judgments under
        `it/judgments`, the run's cache under RUN/judge-cache. JudgeFailed (--judge-failure fail) stops the loop."""
        places = JudgePlaces(
            it / "flows", it / JUDGMENTS_DIR, self.cfg.run_dir / JUDGE_CACHE_DIR, it / "logs"
        )
        counts = judge_sessions(summary.sessions, self.cfg.judge_options(), places)
        if counts.sessions or counts.failed:
            log.info("%s: %s", it.name, counts.line(self.cfg.judge_failure))

    # -- held-out evaluations ------------------------------------------------------------------------------------

    def evaluate(self, k: int, weight_version: str, it: Path | None = None) -> EvalResult:
        """The served weights (`weight_version`) on the held-out tasks: records and rewards under RUN/eval-K (or
        `it`), which no merge reads (the loop merges only iter-K/flows)."""
        cfg, it = self.cfg, it or self.cfg.run_dir / f"eval-{k}"
        self.progress.stage(k, "eval", len(self.eval_tasks) * cfg.eval_samples)
        temperature = 0.0 if cfg.eval_greedy else cfg.temperature
        summary = self._local(it, self.eval_tasks, cfg.eval_samples, self.gateway_options(temperature))
        self._judged(it, summary)
        write_rewards(summary, it / "rewards.parquet", it / "flows")
        result = evaluation_result(
            summary,
            iteration=k,
            weight_version=weight_version,
            samples=cfg.eval_samples,
            greedy=cfg.eval_greedy,
        )
        write_json_atomic(it / "eval.json", result.to_json())
        return result

    # -- sessions through the run's gateways ---------------------------------------------------------------------

    def gateway_options(self, temperature: float | None = None) -> dict[str, str]:
        """Every gateway of the run forces the training temperature (or the evaluation's) and the completion
        budget (none with `--service`: its gateways force its own, checked against these at start)."""
        if self.service is not None:
            return {}
        return {
            "polar_temperature": str(self.cfg.temperature if temperature is None else temperature),
            "polar_max_tokens": str(self.cfg.max_tokens),
            **router.gateway_options(self.engine_url),
        }

    def _run_gateways(self) -> LoopGateways:
        if self.gateways is None:
            self.gateways = LoopGateways(
                router.gateway_backends(self.engine_url, self.cfg.gateways),
                self.cfg.run_dir,
                confdir=self.cfg.run_dir / "mitmproxy",
            )
        return self.gateways

    def _local(
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
        if self.service is not None:
            return self._on_service(it, tasks, group_size, sampler)
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
                    sandbox=cfg.sandbox,
                    image=cfg.image,
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
        with self._run_gateways().serving(it / "flows", gateway_options) as gateways:
            endpoints = [GatewayEndpoints.of(gw) for gw in gateways]
            if sampler is None:
                return asyncio.run(run_wave(tasks))
            return asyncio.run(sample_groups(sampler, run_wave))

    def _on_service(
        self, it: Path, tasks: list[Task], group_size: int, sampler: GroupSampler | None
    ) -> RolloutSummary:
        """`--service`: the sessions (each wave of a `sampler`'s) on the rollout service; results under `it`."""
        import asyncio

        assert self.service is not None
        (it / SERVICE_RESULTS_FILE).unlink(missing_ok=True)  # an attempt a kill interrupted runs again whole
        finished_before = [0]

        async def run_wave(wave: list[Task]) -> RolloutSummary:
            total = finished_before[0] + len(wave) * group_size
            summary = await asyncio.to_thread(
                self.service.rollout,  # type: ignore[union-attr]
                it,
                wave,
                group_size,
                keep=self.cfg.keep,
                on_session=lambda done: self.progress.advance(finished_before[0] + done, total),
            )
            finished_before[0] += len(summary.sessions)
            return summary

        if sampler is None:
            return asyncio.run(run_wave(tasks))
        return asyncio.run(sample_groups(sampler, run_wave))


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
