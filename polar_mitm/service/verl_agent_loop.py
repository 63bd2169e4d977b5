"""verl's agent loop for the rollout service: verl trains, a real harness acts, polar-mitm captures.

Registered in verl's agent-loop registry as `polar_mitm` (`actor_rollout_ref.rollout.agent.default_agent_loop:
polar_mitm`, or a dataset row's `agent_name`). For each sample verl asks for, it submits one session to a running
`polar-mitm serve-rollouts` and returns verl's own `AgentLoopOutput` from the session's trace: `prompt_ids`,
`response_ids` (sampled tokens and the context the harness added between calls), `response_mask` (1 exactly on
sampled tokens), `response_logprobs` (the engine's own, 0.0 where masked) and the task's reward as `reward_score`.

What to run comes from the dataset row: `extra_info.polar_task` is a task-file line (task_id, prompt, eval,
workspace, timeouts), else the row's last user message is the instruction and `extra_info.polar_eval` its check.
Where the service is, and with which harness, from verl's config (`actor_rollout_ref.rollout.polar_mitm.url`,
`.harness`) or the environment (`POLAR_SERVICE_URL`, `POLAR_HARNESS`, `POLAR_SERVICE_TOKEN`). Each call is its own
task (num_samples 1, a fresh task id): the group is verl's (`rollout.n`). Importable only where verl is
(scripts/setup-verl.sh); see recipes/verl.md.
"""

from __future__ import annotations

import os
import uuid
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


def task_line(row: dict[str, Any]) -> dict[str, Any]:
    """The task-file line of a verl dataset row."""
    extra = row.get("extra_info") or {}
    if extra.get("polar_task"):
        return dict(extra["polar_task"])
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


def agent_loop_output(result: SessionResult) -> AgentLoopOutput:
    """verl's output of one finished session: its first trace (one per session under prefix_merging)."""
    if result.status == "ERROR" or not result.trajectory.traces:
        raise BridgeError(f"session {result.session_id}: {result.error or 'no model calls recorded'}")
    trace = result.trajectory.traces[0]
    timing = result.timing
    return AgentLoopOutput(
        prompt_ids=trace.prompt_ids,
        response_ids=trace.response_ids,
        response_mask=trace.loss_mask,
        response_logprobs=trace.response_logprobs,
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
        },
    )


@register(AGENT_NAME)
class PolarMitmAgentLoop(AgentLoopBase):
    """One sample: one real harness session through the rollout service."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        settings = self.rollout_config.get("polar_mitm") or {}
        url = settings.get("url") or os.environ.get("POLAR_SERVICE_URL", "http://127.0.0.1:8700")
        harness = settings.get("harness") or os.environ.get("POLAR_HARNESS", "sdk:openai_chat")
        request = session_request(kwargs, harness)
        async with AsyncClient(url, token=os.environ.get("POLAR_SERVICE_TOKEN")) as client:
            await client.submit(request)
            status = await client.wait(request.task_id, timeout=float(settings.get("timeout", 3600)))
        if not status.results:
            raise BridgeError(f"task {request.task_id}: {status.status} with no finished session")
        return agent_loop_output(status.results[0])
