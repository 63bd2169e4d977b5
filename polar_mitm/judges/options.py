"""`JudgeOptions`: how a rollout reaches its judge, each field an option of `polar-mitm rollout` and `loop` (their
options are generated from these declarations: polar_mitm/config_options.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum

from polar_mitm.config_options import option

JUDGE_API_KEY_ENV = "POLAR_JUDGE_API_KEY"


class JudgeFailure(StrEnum):
    """What a session gets when its judge is down or answers what does not parse."""

    outcome = "outcome"  # its check's reward alone (counted in judgments/summary.json and the closing line)
    fail = "fail"  # the rollout fails: no rewards file is written


@dataclass(frozen=True)
class JudgeOptions:
    """The judge endpoint and its limits; a task's `judge` (tasks/judge_spec.py) says what it is asked."""

    judge_url: str | None = field(
        default=None,
        metadata=option(
            "OpenAI-compatible base URL of the judge (…/v1) for tasks with a `judge`; reached directly, never "
            "through the run's gateways or a proxy."
        ),
    )
    judge_model: str = field(default="judge", metadata=option("Model name sent to the judge."))
    judge_api_key_env: str = field(
        default=JUDGE_API_KEY_ENV,
        metadata=option("Environment variable holding the judge's API key (sent as Bearer, never stored)."),
    )
    judge_timeout: float = field(default=60.0, metadata=option("Seconds per judge call attempt."))
    judge_retries: int = field(
        default=3, metadata=option("Attempts per judge call (exponential backoff between them).")
    )
    judge_concurrency: int = field(default=4, metadata=option("Judge calls in flight at once."))
    judge_failure: JudgeFailure = field(
        default=JudgeFailure.outcome,
        metadata=option(
            "A judge that is down or answers unparseably: outcome (keep the check's reward) | fail."
        ),
    )
    judge_budget: int = field(
        default=12000,
        metadata=option(
            "Characters of a session's trace the judge sees (the long middle is elided, and said so)."
        ),
    )

    def problem(self) -> str | None:
        """A value the judge cannot run with, as one line naming the option; None when all are usable."""
        if self.judge_timeout <= 0:
            return f"--judge-timeout {self.judge_timeout}: must be more than 0"
        if self.judge_retries < 1:
            return f"--judge-retries {self.judge_retries}: must be at least 1"
        if self.judge_concurrency < 1:
            return f"--judge-concurrency {self.judge_concurrency}: must be at least 1"
        if self.judge_budget < 500:
            return f"--judge-budget {self.judge_budget}: must be at least 500 characters"
        return None


_TAKEN_KEYS: dict[str, str | None] = {}


def judge_api_key(env_name: str) -> str | None:
    """The judge's API key from `$env_name`, taken out of this process's environment the first time it is asked for
    (and remembered): a session started afterwards, under `--sandbox none` too, inherits no judge key. The commands
    that judge ask for it before their first session starts."""
    if env_name in os.environ:  # set (again) since last asked: the newest value wins
        _TAKEN_KEYS[env_name] = (os.environ.pop(env_name) or "").strip() or None
    return _TAKEN_KEYS.get(env_name)
