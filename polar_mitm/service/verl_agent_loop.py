"""verl's agent loop for the rollout service: verl trains, a real harness acts, polar-mitm captures.

Registered in verl's agent-loop registry as `polar_mitm` (`actor_rollout_ref.rollout.agent.default_agent_loop:
polar_mitm`, or a dataset row's `agent_name`). For each sample verl asks for, it submits one session to a running
`polar-mitm serve-rollouts` and returns verl's own `AgentLoopOutput` from the session's trace: `prompt_ids`,
`response_ids` (sampled tokens and the context the harness added between calls), `response_mask` (1 exactly on
sampled tokens), `response_logprobs` (the engine's own, 0.0 where masked) and the task's reward as `reward_score`.

What to run comes from the dataset row: `extra_info.polar_task` is a task-file line (task_id, prompt, eval,
workspace, timeouts; a dict, or its JSON text), else the row's last user message is the instruction and
`extra_info.polar_eval` its check. Where the service is, and with which harness, from verl's config
(`+actor_rollout_ref.rollout.custom.polar_mitm.url=…`, `.harness`, `.timeout`, `.submit_wait`: `custom` is the
free-form field of verl's `RolloutConfig`, which refuses keys of its own) or else the environment
(`POLAR_SERVICE_URL`, `POLAR_HARNESS`); the token only from the environment (`POLAR_SERVICE_TOKEN`). Each call is
its own task (num_samples 1, a fresh task id): the group is verl's (`rollout.n`). Importable only where verl is
(scripts/setup-verl.sh); see recipes/verl.md.

Lengths: verl pads every sample to `rollout.prompt_length` + `rollout.response_length`. A response longer than
`response_length` is cut there, as verl's own loops cut theirs (the tokens kept were still sampled in exactly
their context; `extra_fields.polar_response_cut` says how many were dropped). A prompt longer than `prompt_length`
is refused, naming the option: verl's loops left-truncate it, which would train every sampled token in a context
it was not sampled in.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, fields
from typing import Any

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from polar_mitm.service.client import AsyncClient
from polar_mitm.service.models import SessionResult, TaskRequest
from polar_mitm.service.task_requests import line_to_request

AGENT_NAME = "polar_mitm"


class BridgeError(RuntimeError):
    """A sample the service could not turn into a trajectory (the session's error, named)."""


@dataclass(frozen=True)
class ServiceSettings:
    """Where the loop finds the service: `actor_rollout_ref.rollout.custom.polar_mitm`, else the environment."""

    url: str = "http://127.0.0.1:8700"  # else POLAR_SERVICE_URL
    harness: str = "sdk:openai_chat"  # else POLAR_HARNESS
    timeout: float = 3600.0  # seconds a sample waits for its session to finish
    submit_wait: float = 600.0  # seconds a submit retries a service not up yet, or a full queue (429)

    @classmethod
    def of(cls, rollout_config: Any) -> ServiceSettings:
        """The settings in verl's rollout config (its DictConfig, as AgentLoopBase keeps it, or the dataclass)."""
        custom = getattr(rollout_config, "custom", None) or {}  # absent from verl's YAML: Hydra's `+` adds it
        given = dict(custom.get("polar_mitm") or {})
        unknown = given.keys() - {f.name for f in fields(cls)}
        if unknown:
            raise BridgeError(f"rollout.custom.polar_mitm: unknown settings {sorted(unknown)}")
        env = {"url": os.environ.get("POLAR_SERVICE_URL"), "harness": os.environ.get("POLAR_HARNESS")}
        chosen = {**{k: v for k, v in env.items() if v}, **{k: v for k, v in given.items() if v is not None}}
        return cls(
            url=str(chosen.get("url", cls.url)),
            harness=str(chosen.get("harness", cls.harness)),
            timeout=float(chosen.get("timeout", cls.timeout)),
            submit_wait=float(chosen.get("submit_wait", cls.submit_wait)),
        )


def _without_none(value: Any) -> Any:
    """`value` with every None dropped from its dicts, at every depth: Parquet stores a dataset's rows as one
    struct type, so a key one task line lacks comes back as None in the others, which the task schema refuses."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_without_none(v) for v in value]
    return value


def task_line(row: dict[str, Any]) -> dict[str, Any]:
    """The task-file line of a verl dataset row."""
    extra = row.get("extra_info") or {}
    if task := extra.get("polar_task"):
        return _without_none(json.loads(task) if isinstance(task, str | bytes) else dict(task))
    messages = row.get("raw_prompt") or []
    users = [m["content"] for m in messages if m.get("role") == "user"]
    if not users or not extra.get("polar_eval"):
        raise BridgeError(
            "a row needs extra_info.polar_task (a task line), or raw_prompt and extra_info.polar_eval"
        )
    return {"task_id": str(extra.get("index", "verl")), "prompt": users[-1], "eval": extra["polar_eval"]}


def session_request(row: dict[str, Any], harness: str) -> TaskRequest:
    line = task_line(row)
    line["task_id"] = f"{line['task_id']}-{uuid.uuid4().hex[:12]}"  # each call its own task
    return line_to_request(line, harness, num_samples=1)


def agent_loop_output(
    result: SessionResult, prompt_length: int | None = None, response_length: int | None = None
) -> AgentLoopOutput:
    """verl's output of one finished session: its first trace (one per session under prefix_merging), fitted to
    verl's `rollout.prompt_length` / `rollout.response_length` (None: no limit)."""
    if result.status == "ERROR" or not result.trajectory.traces:
        raise BridgeError(f"session {result.session_id}: {result.error or 'no model calls recorded'}")
    trace = result.trajectory.traces[0]
    if prompt_length is not None and len(trace.prompt_ids) > prompt_length:
        raise BridgeError(
            f"session {result.session_id}: the harness's first prompt is {len(trace.prompt_ids)} tokens, over "
            f"actor_rollout_ref.rollout.prompt_length={prompt_length}: set it to at least {len(trace.prompt_ids)} "
            "(a cut prompt would train every token in a context it was not sampled in)"
        )
    keep = (
        len(trace.response_ids) if response_length is None else min(response_length, len(trace.response_ids))
    )
    timing = result.timing
    return AgentLoopOutput(
        prompt_ids=trace.prompt_ids,
        response_ids=trace.response_ids[:keep],
        response_mask=trace.loss_mask[:keep],
        response_logprobs=trace.response_logprobs[:keep],
        reward_score=trace.reward,
        num_turns=2 * int(trace.metadata.get("n_turns") or 1) + 1,  # verl counts user and assistant messages
        metrics=AgentLoopMetrics(
            generate_sequences=timing.run_ms / 1000, compute_score=timing.postrun_ms / 1000
        ),
        extra_fields={
            "polar_session_id": result.session_id,
            "polar_traces": len(result.trajectory.traces),
            "weight_version_min": trace.metadata.get("weight_version_min"),
            "weight_version_max": trace.metadata.get("weight_version_max"),
            "polar_response_cut": len(trace.response_ids) - keep,  # tokens past rollout.response_length
        },
    )


@register(AGENT_NAME)
class PolarMitmAgentLoop(AgentLoopBase):
    """One sample: one real harness session through the rollout service."""

    @property
    def settings(self) -> ServiceSettings:
        return ServiceSettings.of(self.rollout_config)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        settings = self.settings
        request = session_request(kwargs, settings.harness)
        token = os.environ.get("POLAR_SERVICE_TOKEN")
        async with AsyncClient(settings.url, token=token, submit_wait=settings.submit_wait) as client:
            await client.submit(request)
            status = await client.wait(request.task_id, timeout=settings.timeout)
        if not status.results:
            raise BridgeError(f"task {request.task_id}: {status.status} with no finished session")
        rollout = self.rollout_config
        return agent_loop_output(
            status.results[0],
            prompt_length=getattr(rollout, "prompt_length", None),  # verl's RolloutConfig always has both
            response_length=getattr(rollout, "response_length", None),
        )
