"""The rollout service's wire format: Polar's (NVIDIA-NeMo/ProRL-Agent-Server `polar/rollout/models.py`,
`polar/trajectory/models.py`), written from its field names and rules, so a client built for Polar — its slime
bridge among them — talks to us unchanged.

A trainer submits a `TaskRequest` (one task, `num_samples` sessions of it) and reads a `TaskStatus` whose `results`
are one `SessionResult` per finished session; a result's `trajectory.traces` are what it trains on: `prompt_ids` +
`response_ids` exactly the tokens the engine saw and sampled, `loss_mask` 1 exactly on sampled tokens, and
`response_logprobs` the recorded ones (0.0 where masked). Unknown request fields are refused (a misspelt
`num_sample` would otherwise run one session silently); `agent` and `metadata` take what a harness or a client adds.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SessionStatus(StrEnum):
    """A session's state on the wire: the stages while it runs, one of the last three once it is done."""

    REGISTERED = "REGISTERED"
    INITIALIZING = "INITIALIZING"
    READY = "READY"
    RUNNING = "RUNNING"
    POST_RUN = "POST_RUN"
    COMPLETED = "COMPLETED"
    ERROR = "ERROR"
    TIMEOUT = "TIMEOUT"


TERMINAL = (SessionStatus.COMPLETED, SessionStatus.ERROR, SessionStatus.TIMEOUT)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StrategySpec(_Request):
    """A builder or evaluator strategy by name, with its own settings."""

    strategy: str
    config: dict[str, Any] = Field(default_factory=dict)


class BuilderSpec(StrategySpec):
    strategy: Literal["per_request", "prefix_merging"] = "prefix_merging"


class EvaluatorSpec(StrategySpec):
    """How a session is rewarded: `command` runs `config.command` in the workspace (our task file's `eval`);
    `harbor` runs a Harbor task's verifier (`config`: our task file's `eval.harbor`: tests, solution, workdir, env,
    reward_rule)."""

    strategy: Literal["command", "harbor"] = "command"
    env: dict[str, str] = Field(default_factory=dict)
    refresh_runtime: bool = False


class AgentSpec(BaseModel):
    """Which harness runs the sessions: any of ours (`claude-code`, `sdk:openai_chat`, `cmd:…`)."""

    model_config = ConfigDict(extra="allow")

    harness: str
    config: dict[str, Any] = Field(default_factory=dict)


class TaskRequest(_Request):
    """A task the trainer submits: `num_samples` sessions of one instruction (a GRPO group)."""

    task_id: str = Field(min_length=1, max_length=200)
    instruction: str
    num_samples: int = Field(default=1, ge=1)
    dispatch_priority: int = Field(default=0, ge=0, le=100)
    early_stop_min_usable_sessions: int | None = Field(default=None, ge=1)
    timeout_seconds: float = Field(default=600.0, gt=0)
    agent: AgentSpec
    builder: BuilderSpec = Field(default_factory=BuilderSpec)
    evaluator: EvaluatorSpec | None = None
    callback_url: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _early_stop_within_samples(self) -> TaskRequest:
        if (self.early_stop_min_usable_sessions or 0) > self.num_samples:
            raise ValueError("early_stop_min_usable_sessions cannot exceed num_samples")
        return self


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("reward must be numeric, not boolean")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError("reward must be finite")
    return number


class Trace(BaseModel):
    """One training sequence: a merged session (`prefix_merging`) or one model call (`per_request`)."""

    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    prompt_messages: list[dict[str, Any]] = Field(default_factory=list)
    response_messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    response_logprobs: list[float] | None = None
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_finite(cls, value: Any) -> float | None:
        return _finite(value)

    @model_validator(mode="after")
    def _response_lengths(self) -> Trace:
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask values must be 0 or 1")
        if self.loss_mask and len(self.loss_mask) != len(self.response_ids):
            raise ValueError("loss_mask length must match response_ids length")
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response_ids):
            raise ValueError("response_logprobs length must match response_ids length")
        return self


class Trajectory(BaseModel):
    status: Literal["COMPLETED", "TIMEOUT", "ERROR"]
    metadata: dict[str, Any] = Field(default_factory=dict)
    traces: list[Trace] = Field(default_factory=list)
    error: str | None = None


class SessionTiming(BaseModel):
    """Per-session milliseconds (Polar's names; the ones our stages give, the rest 0)."""

    model_config = ConfigDict(extra="allow")

    init_ms: float = 0.0
    ready_queue_ms: float = 0.0
    run_ms: float = 0.0
    postrun_queue_ms: float = 0.0
    postrun_ms: float = 0.0
    e2e_ms: float = 0.0


class SessionResult(BaseModel):
    session_id: str
    task_id: str
    status: SessionStatus
    trajectory: Trajectory
    timing: SessionTiming = Field(default_factory=SessionTiming)
    node_id: str | None = None
    error: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class TaskStatus(BaseModel):
    """A task's state: `running`, `completed` or `failed` (cancelled tasks are `failed` with what finished)."""

    task_id: str
    status: Literal["running", "completed", "failed"]
    total_sessions: int
    completed_sessions: int
    results: list[SessionResult] = Field(default_factory=list)
    result_paths: list[str] = Field(default_factory=list)


class SubmitAccepted(BaseModel):
    task_id: str
    status: Literal["running"] = "running"


class WeightsUpdate(_Request):
    """`POST /rollout/weights`: load a checkpoint into the engine(s); later sessions are sampled by it."""

    path: str
    weight_version: str | None = None
