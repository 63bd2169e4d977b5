"""The rollout service's wire format: Polar's (NVIDIA-NeMo/ProRL-Agent-Server `polar/rollout/models.py`,
`polar/trajectory/models.py`), written from its field names and rules, so a client built for Polar — its slime
bridge among them — talks to us unchanged.

A trainer submits a `TaskRequest` (one task, `num_samples` sessions of it) and reads a `TaskStatus` whose `results`
are one `SessionResult` per finished session; a result's `trajectory.traces` are what it trains on: `prompt_ids` +
`response_ids` exactly the tokens the engine saw and sampled, `loss_mask` 1 exactly on sampled tokens, and
`response_logprobs` the recorded ones (0.0 where masked). Unknown request fields are refused (a misspelt
`num_sample` would otherwise run one session silently); `agent` and `metadata` take what a harness or a client adds.

Every field Polar's own models carry is accepted, so what its client sends (`model_dump()`, each optional field
null or at its default) parses. A value that asks for something we do not do is refused, naming the field, instead
of being dropped: a per-task container `runtime` other than the service's own sandbox (task_requests.py checks it
against `--sandbox`/`--image`), `agent.import_path`, `agent.env`, `agent.settings`, `agent.mcp_servers`,
`agent.skills_path`, `evaluator.refresh_runtime`. `agent.model_name` is taken and not used: every session samples
the service's engine, whatever its harness calls the model.

Defaults that differ from Polar's: `builder.strategy` is `prefix_merging` (Polar: `per_request`); a client that
dumps its model always sends it, so only a hand-written request that leaves `builder` out gets ours.
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
# The `/events` event a subscriber gets after the service dropped events it read too slowly to take (each subscriber
# has a bounded buffer): whatever it waits for must be asked after again.
LAGGED_EVENT = "lagged"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _unsupported(value: Any, default: Any, why: str) -> Any:
    """`value` if it is the field's default (what a Polar client's dump sends), else a refusal saying why."""
    if value not in (default, None):
        raise ValueError(f"not supported: {why}")
    return value


class StrategySpec(_Request):
    """A builder or evaluator strategy by name, with its own settings."""

    strategy: str
    config: dict[str, Any] = Field(default_factory=dict)


class BuilderSpec(StrategySpec):
    strategy: Literal["per_request", "prefix_merging"] = "prefix_merging"


class EvaluatorSpec(StrategySpec):
    """How a session is rewarded: `command` runs `config.command` in the workspace (our task file's `eval`);
    `harbor` runs a Harbor task's verifier (`config`: our task file's `eval.harbor`: tests, solution, workdir, env,
    reward_rule); `rubric` adds an LLM judge's score to an outcome check (`config`: {judge: our task file's
    `judge`, command and reward, or harbor}; judged by the service's `--judge-url`: service/judging.py)."""

    strategy: Literal["command", "harbor", "rubric"] = "command"
    env: dict[str, str] = Field(default_factory=dict)
    refresh_runtime: bool = False

    @field_validator("refresh_runtime")
    @classmethod
    def _same_runtime(cls, value: bool) -> bool:
        return _unsupported(
            value, False, "the check runs in the session's own sandbox once its harness ended"
        )


# Polar's preset names (its `polar/agent/factory.py`) that differ from ours; codex, hermes, openclaw, opencode and pi
# are the same in both. Its `shell` preset runs `agent.custom_shell.command`: our `cmd:` template.
POLAR_HARNESS_NAMES = {
    "claude_code": "claude-code",
    "gemini_cli": "gemini",
    "mini_swe_agent": "mini-swe-agent",
    "openhands_sdk": "openhands",
    "qwen_code": "qwen",
}


class ShellCommand(_Request):
    """Polar's `agent.custom_shell` (an ExecInput): the command its `shell` harness runs. It runs as our `cmd:`
    template, in the session's workspace and environment, so only `command` may be set."""

    command: str = Field(min_length=1)
    cwd: str | None = None
    env: dict[str, str] | None = None
    timeout_sec: float | None = None

    @field_validator("cwd")
    @classmethod
    def _no_cwd(cls, value: str | None) -> str | None:
        return _unsupported(value, None, "the command runs in the session's workspace ({workspace})")

    @field_validator("env")
    @classmethod
    def _no_env(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _unsupported(value, {}, "a session's environment is the sandbox's and the gateway's")

    @field_validator("timeout_sec")
    @classmethod
    def _no_timeout(cls, value: float | None) -> float | None:
        return _unsupported(value, None, "the harness's time is metadata.agent_timeout (or timeout_seconds)")


class AgentSpec(BaseModel):
    """Which harness runs the sessions: any of ours (`claude-code`, `sdk:openai_chat`, `cmd:…`), or Polar's name
    for it (`claude_code`, `gemini_cli`, `qwen_code`, …; `shell` with `custom_shell.command`), which becomes ours
    here. Polar's own fields are accepted at their defaults (see the module's docstring)."""

    model_config = ConfigDict(extra="allow")

    harness: str
    custom_shell: ShellCommand | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    import_path: str | None = None
    model_name: str | None = None  # taken, not used: the service's engine samples every session
    settings: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    mcp_servers: list[Any] = Field(default_factory=list)
    skills_path: str | None = None

    @field_validator("import_path", "skills_path")
    @classmethod
    def _no_python_harnesses(cls, value: str | None) -> str | None:
        return _unsupported(
            value, None, "harnesses are ours, by name in agent.harness (`polar-mitm harness list`)"
        )

    @field_validator("config", "settings")
    @classmethod
    def _no_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _unsupported(value, {}, "a harness is configured by its name (claude-code, cmd:TEMPLATE, …)")

    @field_validator("env")
    @classmethod
    def _no_env(cls, value: dict[str, str]) -> dict[str, str]:
        return _unsupported(value, {}, "a session's environment is the sandbox's and the gateway's")

    @field_validator("mcp_servers")
    @classmethod
    def _no_mcp(cls, value: list[Any]) -> list[Any]:
        return _unsupported(value, [], "MCP servers are not wired into our harnesses")

    @model_validator(mode="after")
    def _our_harness_name(self) -> AgentSpec:
        """Polar's preset names as ours; `shell` as the `cmd:` template of its custom_shell."""
        if self.harness == "shell":
            if self.custom_shell is None:
                raise ValueError("harness shell runs agent.custom_shell.command: give custom_shell {command}")
            self.harness, self.custom_shell = f"cmd:{self.custom_shell.command}", None
        elif self.custom_shell is not None:
            raise ValueError(f"custom_shell is the command of harness shell, not of {self.harness}")
        self.harness = POLAR_HARNESS_NAMES.get(self.harness, self.harness)
        return self


class RuntimeSpec(_Request):
    """Polar's per-session container (its field names and defaults). Our sessions run in the service's own sandbox
    (`--sandbox`, `--image`); a runtime that asks for that image is accepted, anything else refused (checked in
    task_requests.py, which knows the service's sandbox)."""

    backend: Literal["docker", "apptainer"] = "docker"
    image: str = Field(min_length=1)
    prepare: list[dict[str, Any]] = Field(default_factory=list)
    eval_prepare: list[dict[str, Any]] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    network: str | None = "host"
    workdir: str | None = None
    direct_exec_init_command: str | None = None
    cpus: int | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    gpus: int = 0
    allow_internet: bool = True
    internet_volumes: list[str] = Field(default_factory=list)
    import_path: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)

    def unsupported(self) -> list[str]:
        """The fields set away from Polar's defaults, other than `backend` and `image` (none of them we do)."""
        defaults = RuntimeSpec(image=self.image)
        return [
            name
            for name in type(self).model_fields
            if name not in ("backend", "image") and getattr(self, name) != getattr(defaults, name)
        ]


class TaskRequest(_Request):
    """A task the trainer submits: `num_samples` sessions of one instruction (a GRPO group)."""

    task_id: str = Field(min_length=1, max_length=200)
    instruction: str
    num_samples: int = Field(default=1, ge=1)
    dispatch_priority: int = Field(default=0, ge=0, le=100)
    early_stop_min_usable_sessions: int | None = Field(default=None, ge=1)
    timeout_seconds: float = Field(default=600.0, gt=0)
    runtime: RuntimeSpec | None = None
    agent: AgentSpec
    builder: BuilderSpec = Field(default_factory=BuilderSpec)
    evaluator: EvaluatorSpec | None = None
    callback_url: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("metadata")
    @classmethod
    def _min_weight_version_whole(cls, value: dict[str, Any]) -> dict[str, Any]:
        wanted = value.get("min_weight_version")
        if wanted is not None and whole_version(wanted) is None:
            raise ValueError(
                f"min_weight_version must be a whole number ≥ 0 (a weight_version), not {wanted!r}"
            )
        return value

    @field_validator("metadata")
    @classmethod
    def _agent_timeout_positive(cls, value: dict[str, Any]) -> dict[str, Any]:
        limit = value.get("agent_timeout")
        if limit is not None and (
            isinstance(limit, bool)
            or not isinstance(limit, int | float)
            or not math.isfinite(limit)
            or limit <= 0
        ):
            raise ValueError(f"agent_timeout must be a positive number of seconds, not {limit!r}")
        return value

    @model_validator(mode="after")
    def _early_stop_within_samples(self) -> TaskRequest:
        if (self.early_stop_min_usable_sessions or 0) > self.num_samples:
            raise ValueError("early_stop_min_usable_sessions cannot exceed num_samples")
        return self

    @property
    def agent_timeout(self) -> float | None:
        """`metadata.agent_timeout`: Polar's budget for the harness's run alone (RUN), beside the whole session's
        `timeout_seconds`; the run stops at whichever comes first."""
        limit = self.metadata.get("agent_timeout")
        return None if limit is None else float(limit)

    @property
    def min_weight_version(self) -> int | None:
        """`metadata.min_weight_version`: no session starts before the engine serves this version or a later one."""
        wanted = self.metadata.get("min_weight_version")
        return None if wanted is None else whole_version(wanted)


def whole_version(value: Any) -> int | None:
    """A weight version as a number (`3`, `"3"`), or None when it is not one (`"step-3"`, `True`, `-1`)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    return int(value) if isinstance(value, str) and value.isdigit() else None


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
