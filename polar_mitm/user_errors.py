"""Which exceptions are a user's mistake, and how `polar-mitm` says them: one line on stderr and exit 2.

Every check that meets bad input (a task file, an option value, a folder with nothing in it, an engine that does
not answer, a shard cut short) raises one of its own error classes with a message that names the file, line or
option and what to do. `polar_mitm.cli.main` turns exactly those into one line; any other exception is our bug
and keeps its traceback. `--debug` (or `POLAR_DEBUG=1`) shows the traceback of a user error too.

The classes are looked up only when something was raised, so a command that succeeds imports none of their modules.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

# (module, class): each the error its module raises for input it refuses.
USER_ERRORS = (
    ("polar_mitm.storage.location", "StorageError"),  # also MergeError, RewardsError
    ("polar_mitm.storage.location", "InputNotFound"),
    ("polar_mitm.storage.merged", "MergedDataError"),
    ("polar_mitm.storage.records", "RecordError"),
    ("polar_mitm.tasks.task_file", "TaskFileError"),
    ("polar_mitm.tasks.swe", "InstanceError"),
    ("polar_mitm.tasks.harbor", "HarborTaskError"),
    ("polar_mitm.engines.keys", "KeyFileError"),
    ("polar_mitm.engines.router", "EngineUnreachable"),
    ("polar_mitm.engine.script", "ScriptError"),
    ("polar_mitm.rollout.harness_spec", "HarnessSpecError"),
    ("polar_mitm.rollout.shell_template", "TemplateError"),
    ("polar_mitm.sandbox.base", "SandboxUnavailable"),
    ("polar_mitm.sandbox.tunnel", "TunnelError"),
    ("polar_mitm.loop.run_state", "RunRecordError"),
    ("polar_mitm.gateway.import_flows", "FlowFileError"),
    ("polar_mitm.gateway.options", "OptionError"),
    ("polar_mitm.service.task_requests", "RequestError"),
    ("polar_mitm.loop.service_rollouts", "ServiceSetupError"),
    ("polar_mitm.train.activation_memory", "MicroBatchTooLarge"),
)
DEBUG_ENV = "POLAR_DEBUG"


class UserInputError(Exception):
    """A mistake in what the user gave that no module-specific class covers (raised by the CLI itself)."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The user-error classes whose modules import here (an optional extra not installed: its class is skipped)."""
    found: list[type[BaseException]] = [UserInputError]
    for module, name in USER_ERRORS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except ImportError:
            continue
    return tuple(found)


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(exc: BaseException) -> str:
    """The error's message as one line (messages from pyarrow and pydantic run over several)."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text or type(exc).__name__


def run_command(app: Any, argv: list[str] | None, prog_name: str) -> None:
    """Run a Typer `app` as a command: a mistake in the user's input is said in one line with exit 2; any other
    exception is ours and keeps its traceback (as does every one under $POLAR_DEBUG=1)."""
    try:
        app(args=argv, prog_name=prog_name)
    except Exception as exc:
        if debugging() or not isinstance(exc, user_error_types()):
            raise
        print(f"{prog_name}: {one_line(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
