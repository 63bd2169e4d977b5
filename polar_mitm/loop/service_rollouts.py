"""`polar-mitm loop --service URL`: the loop as the rollout service's first client — every rollout and evaluation
runs on a running `polar-mitm serve-rollouts`, and the loop trains on the traces it answers.

An iteration's tasks are submitted as Polar TaskRequests (`task_requests.task_to_request`, ids made unique per run
and iteration), the finished `SessionResult`s are kept as they came (`iter-K/service_results.jsonl`, the wire format),
their rewards become the rewards file, and the merge stage turns their traces back into the merged rows
`polar-mitm merge` writes (`traces.merged_sequence`): below the HTTP layer the service runs the same staged runner
and the same merge as the in-process loop. The weights go to the service's engine through `POST /rollout/weights`
(a checkpoint path the service can read: the same machine or a shared file system).

What the service forces on every call (temperature, completion budget) is checked against the loop's own settings
before anything runs: a run trained at another temperature than it sampled at would get wrong importance ratios.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_mitm.rollout.runner import RolloutSummary, SessionRun
from polar_mitm.service import TOKEN_ENV
from polar_mitm.service.client import Client, ServiceError
from polar_mitm.service.models import SessionResult, TaskRequest
from polar_mitm.service.task_requests import task_to_request
from polar_mitm.service.traces import merged_sequence
from polar_mitm.storage import json_lines
from polar_mitm.storage.merged import MergedSequence
from polar_mitm.storage.run_layout import SERVICE_RESULTS_FILE
from polar_mitm.storage.session_ends import (
    EndRule,
    EndRules,
    SessionEnd,
    combine,
    rule_key,
    status_end,
)
from polar_mitm.tasks.task_file import Task

if TYPE_CHECKING:
    from polar_mitm.loop.config import LoopConfig
    from polar_mitm.reconstruct.merge import MergeSummary

SUBMIT_RETRY_S = 1.0  # a full queue (429) is waited out: the service's sessions free its slots


class ServiceSetupError(ValueError):
    """A service the loop cannot train through as configured (one line: what differs and what to do)."""


@dataclass(frozen=True)
class ServiceSettings:
    """The loop's settings a service must share."""

    temperature: float
    max_tokens: int


# Loop options that name what the service owns (its engine, its gateways, where its sessions run).
SERVICE_OWNS = {
    "engine_url": "--engine (the service's engine is the one trained)",
    "ray_address": "--ray (start the service with its own placement)",
    "script": "--script (give it to `serve-rollouts`)",
}


def check_service(cfg: LoopConfig) -> None:
    """`--service` with an option only the service can honour: refused with the way to say it (ServiceSetupError)."""
    if cfg.service_url is None:
        return
    for name, said in SERVICE_OWNS.items():
        if getattr(cfg, name) is not None:
            raise ServiceSetupError(f"--service with {said}: not both")
    if cfg.gateways != 1:
        raise ServiceSetupError(
            "--service with --gateways: the service's gateways are its own (`serve-rollouts --gateways`)"
        )
    if cfg.eval_greedy:
        raise ServiceSetupError(
            "--service with --eval-greedy: the service samples every call at its one --temperature; evaluate at it"
        )
    if cfg.grpo.get("push_every_steps"):
        raise ServiceSetupError(
            "--service with --push-every-steps: the weights reach the service after each training"
        )


def run_tag(run_dir: Path) -> str:
    """A run's prefix for the ids it submits (two runs on one service never share a task id): its folder's name
    and a digest of its path."""
    import hashlib

    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in run_dir.name)[:40] or "run"
    return f"{name}-{digest}"


class LoopService:
    """The rollout service at `url`, as the loop uses it: checked once, then waves of tasks and weight pushes."""

    def __init__(self, url: str, harness: str, builder: str, run_tag: str) -> None:
        self.url, self.harness, self.builder, self.run_tag = url, harness, builder, run_tag
        self.client = Client(url, os.environ.get(TOKEN_ENV) or None, timeout=60.0)

    def close(self) -> None:
        self.client.__exit__()

    # -- set-up -------------------------------------------------------------------------------------------------

    def check(self, settings: ServiceSettings) -> dict[str, Any]:
        """The service's health, once its forced sampling is known to be the loop's; ServiceSetupError otherwise."""
        try:
            health = self.client.health()
        except ServiceError as exc:
            hint = f" (set {TOKEN_ENV})" if exc.status_code == 401 else ""
            raise ServiceSetupError(f"--service {self.url}: {exc}{hint}") from None
        except OSError as exc:
            raise ServiceSetupError(f"--service {self.url}: no service answers ({exc})") from None
        sampling = health.get("sampling") or {}
        wanted = {"polar_temperature": settings.temperature, "polar_max_tokens": settings.max_tokens}
        flags = {"polar_temperature": "--temperature", "polar_max_tokens": "--max-tokens"}
        for name, value in wanted.items():
            forced = sampling.get(name)
            if forced is None or not math.isclose(float(forced), float(value)):
                said = "forces none" if forced is None else f"forces {forced}"
                raise ServiceSetupError(
                    f"--service {self.url}: the service {said} for {flags[name]}, the loop trains with {value}; "
                    f"start it with `serve-rollouts --temperature {settings.temperature} "
                    f"--max-tokens {settings.max_tokens}`"
                )
        return health

    def weight_version(self) -> str | None:
        return self.client.health().get("weight_version")

    def push(self, path: Path, version: str | None) -> dict[str, Any]:
        """The service's engine loads `path` (read by the service, so on its machine) as `version`; what the push
        did (PushReport's fields)."""
        return self.client.push_weights_reported(str(path.resolve()), version)

    # -- rollouts -----------------------------------------------------------------------------------------------

    def rollout(
        self,
        it: Path,
        tasks: list[Task],
        group_size: int,
        *,
        keep: int | None = None,
        on_session: Callable[[int], None] = lambda done: None,
    ) -> RolloutSummary:
        """`group_size` sessions per task on the service; each finished result appended to
        `it/service_results.jsonl` (fsynced) before it counts. Sessions come back in task and sample order."""
        started = time.monotonic()
        it.mkdir(parents=True, exist_ok=True)
        results_file = it / SERVICE_RESULTS_FILE
        requests = [self.request(it, task, group_size, keep) for task in tasks]
        by_submit: dict[str, Task] = {
            request.task_id: task for request, task in zip(requests, tasks, strict=True)
        }
        sessions: list[SessionRun] = []
        for status in self.client.run(requests, retry_full=SUBMIT_RETRY_S):
            task = by_submit[status.task_id]
            for result in status.results:
                json_lines.append_line(results_file, result.model_dump(mode="json"))
                sessions.append(session_of(result, task))
                on_session(len(sessions))
        sessions.sort(key=lambda s: (tasks.index(s.task), s.index))
        return RolloutSummary(sessions, time.monotonic() - started, 0.0)

    def request(self, it: Path, task: Task, group_size: int, keep: int | None) -> TaskRequest:
        """Task `task` of rollout folder `it` as a submit: its id unique per run and folder (`RUN-TAG:iter-K:TASK`)."""
        request = task_to_request(
            task,
            self.harness,
            group_size,
            self.builder,
            task_id=f"{self.run_tag}:{it.name}:{task.task_id}",
            metadata={"loop_task_id": task.task_id, "loop_rollout": it.name},
        )
        return request.model_copy(update={"early_stop_min_usable_sessions": keep})


def session_of(result: SessionResult, task: Task) -> SessionRun:
    """The runner's view of a finished service session (what the rewards file and the loop's figures read)."""
    meta = result.trajectory.metadata
    s = SessionRun(task=task, index=int(result.metadata.get("sample_index", 0)), session_id=result.session_id)
    s.stage, s.status = "done", str(meta.get("outcome") or "error")
    # How it ended: the runner's status there, and what its calls said (each trace carries its session's end)
    traced = next((t.metadata.get("end") for t in result.trajectory.traces if t.metadata.get("end")), None)
    s.end = combine(status_end(s.status), traced)
    s.reward, s.exit_code = meta.get("reward"), meta.get("exit_code")
    s.eval_output = result.error or ""
    at = 0.0
    for stage, ms in (
        ("init", result.timing.init_ms),
        ("run", result.timing.run_ms),
        ("post", result.timing.postrun_ms),
    ):
        s.spans[stage] = (at, at + ms / 1000)
        at += ms / 1000
    return s


def recorded_results(it: Path) -> list[SessionResult]:
    """The service results a rollout of `it` kept (empty if it ran in process)."""
    return [SessionResult.model_validate(row) for row in json_lines.read_lines(it / SERVICE_RESULTS_FILE)]


def loop_task_id(submitted: str) -> str:
    """The loop's task id of a submit id (`RUN-TAG:iter-K:TASK`; a task id may hold `:` itself)."""
    return submitted.split(":", 2)[-1]


def merge_results(it: Path, output: Path, builder: str, end_rules: EndRules | None = None) -> MergeSummary:
    """Iteration folder `it`'s service results as merged shards under `output`, with the summary `merge` writes;
    `end_rules` applied to each rewarded session as the in-process merge applies them (counted the same way)."""
    from polar_mitm.reconstruct.merge import MergeSummary
    from polar_mitm.reconstruct.turns import sequences_to_table
    from polar_mitm.storage.merged import ShardWriter

    started = time.perf_counter()
    results = recorded_results(it)
    sequences: list[MergedSequence] = []
    summary = MergeSummary(builder=builder, inputs=1, sessions=len(results))
    rules_applied: Counter[str] = Counter()
    for result in results:
        traces = result.trajectory.traces
        summary.records += len({r for t in traces for r in t.metadata.get("request_ids", [])})
        mine = [merged_sequence(trace) for trace in traces]
        end = combine(status_end(result.trajectory.metadata.get("outcome")), *(seq.end for seq in mine))
        for seq in mine:
            seq.task_id, seq.end = loop_task_id(result.task_id), end
        if traces:
            rewarded = result.trajectory.metadata.get("reward") is not None
            summary.rewarded_sessions += rewarded
            summary.unrewarded_sessions += not rewarded
            if rewarded and end_rules is not None:
                mine = ruled(mine, end_rules, rules_applied, summary)
        sequences += mine
    summary.end_rules = dict(sorted(rules_applied.items()))
    sequences = [seq for seq in sequences if seq.reward is not None]  # as the loop's merge: --drop-unrewarded
    writer = ShardWriter(str(output))
    if sequences:
        writer.write(sequences_to_table(sequences))
    summary.sequences = len(sequences)
    summary.trainable_records = sum(seq.n_turns for seq in sequences)
    summary.total_tokens = sum(len(seq.input_ids) for seq in sequences)
    summary.trainable_tokens = sum(sum(seq.loss_mask) for seq in sequences)
    summary.shards, summary.seconds = writer.shards, time.perf_counter() - started
    writer.write_summary(summary.to_json())
    return summary


def ruled(
    sequences: list[MergedSequence], rules: EndRules, applied: Counter[str], summary: MergeSummary
) -> list[MergedSequence]:
    """A rewarded session's sequences under its end's rule (reconstruct/merge.py's, counted the same way): none when
    masked, the failure reward when zeroed."""
    end = sequences[0].end if sequences else None
    if end is None or end == SessionEnd.COMPLETED:
        return sequences
    rule = rules.rule(end)
    applied[rule_key(end, rule)] += 1
    if rule is EndRule.mask:
        summary.masked_sequences += len(sequences)
        return []
    for seq in sequences:
        seq.reward = rules.reward(end, seq.reward)  # type: ignore[arg-type]
    return sequences


def call_versions(it: Path, sessions: set[str]) -> list[str | None]:
    """The weight version of each call of `sessions` in `it`'s service results (the loop's staleness figure)."""
    seen: dict[str, str | None] = {}
    for result in recorded_results(it):
        if result.session_id in sessions:
            for trace in result.trajectory.traces:
                meta = trace.metadata
                seen.update(
                    zip(meta.get("request_ids", []), meta.get("request_weight_versions", []), strict=False)
                )
    return list(seen.values())
