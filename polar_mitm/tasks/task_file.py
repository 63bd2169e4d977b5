"""The task file (JSONL): one task per line, each a prompt, a workspace, an evaluation and timeouts.

    {"task_id": "hello-file",
     "prompt": "Create out.txt containing the word hello.",
     "workspace": {"dir": "tasks/hello", "setup": ["git init -q"]},      # dir is copied per session
     "eval": {"command": "grep -q hello out.txt", "reward": "exit"},      # exit: 1.0 if exit 0 else 0.0
     "timeouts": {"init": 60, "run": 300, "eval": 60},                     # seconds
     "limits": {"memory_mb": 4096, "pids": 1024}}                          # its sandbox's (sandbox/limits.py)

Every line is checked against a schema (`TaskLine`, pydantic) before anything runs: an unknown field — a misspelt
`evaluation`, say — is refused with the likely one named, `eval` is required (there is no default check: one that
passed everything would reward every session alike), a `workspace.dir` must be a folder. Your own data goes under
`meta`; `family` and `swe` are what `polar-mitm tasks generate` / `tasks swe` write. `"eval": "COMMAND"` is short
for `{"command": "COMMAND"}`. `eval.reward` = "exit" (default) or "stdout" (the last number printed is the reward). `"eval": {"harbor": {…}}` grades
the session as a Harbor task's verifier does (`tests/test.sh`, its reward file: see `HarborSpec` and
polar_mitm/tasks/harbor_grading.py); `polar-mitm tasks harbor` writes such lines. `"judge": {"mode": "rubric", …}`
adds an LLM judge's score to the check's reward (tasks/judge_spec.py). A session *passes* (pass rates,
pass@k) when its reward reaches full marks, 1.0 (`passed`): a graded check's partial credit is reward, not a pass.
The evaluation runs in the session's workspace with `$POLAR_HARNESS_OUTPUT` naming the harness's output (its log),
for checks that grade the agent's final answer (`python -P -m polar_mitm.tasks.answer_check`). A relative `workspace.dir`
is resolved against the task file's folder; `workspace.git` clones a repository (local path, scp-like address, or a
file/http(s)/ssh/git URL; transport helpers such as `ext::` are refused) instead — git gets it as one argument,
never through a shell.

Task ids: any text except empty, '/', '.', '..', control or separator characters (NUL, ESC, newlines, DEL, U+2028…)
and more than 200 bytes — see `polar_mitm.harness.base.id_problem`. Shell syntax in an id is harmless: every place an
id reaches a shell quotes it. A bad line is rejected at load with its line number, before anything runs.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    StringConstraints,
    ValidationError,
    model_serializer,
    model_validator,
)

from polar_mitm.harness.base import id_problem
from polar_mitm.sandbox.limits import Limits, LimitsSpec
from polar_mitm.tasks.judge_spec import JudgeSpec, TaskJudge

GIT_URL_SCHEMES = (
    "file",
    "http",
    "https",
    "ssh",
    "git",
    "git+ssh",
    "ssh+git",
)  # transports git itself speaks
GIT_HELPER = re.compile(
    r"([A-Za-z0-9+.-]*)::"
)  # git's own test (transport.c): NAME:: selects a remote helper
GIT_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


FULL_MARKS = 1.0


def passed(reward: float) -> bool:
    """Whether a session's reward is a pass: full marks (an exit-code check's 1.0, a graded check's top grade)."""
    return reward >= FULL_MARKS


class TaskFileError(ValueError):
    """A task file line that cannot be used (with its line number)."""


@dataclass
class Timeouts:
    init: float = 120.0
    run: float = 600.0
    eval: float = 120.0


@dataclass(frozen=True)
class HarborEval:
    """A Harbor task's verifier (`"eval": {"harbor": …}`), its folders resolved; graded by tasks/harbor_grading.py."""

    tests: Path  # copied to /tests only when the agent is done; `bash /tests/test.sh` runs there
    workdir: str = "/app"  # where the session's workspace is mounted while the agent and the verifier run
    solution: Path | None = None  # solution/solve.sh: the oracle `polar-mitm tasks check` runs
    env: dict[str, str] = field(default_factory=dict)  # the verifier's environment variables
    reward_rule: str = "only"  # how reward.json's named numbers become one reward (HarborSpec.reward_rule)
    user: str | None = None  # always None: a line's eval.harbor.user is refused (USER_NOT_APPLIED)


# A harbor task's `eval_command`, for a runner that does not grade harbor tasks: it fails, never rewards.
HARBOR_UNGRADED = "echo 'this runner cannot grade a Harbor task (eval.harbor)' >&2; exit 1"


@dataclass
class Task:
    task_id: str
    prompt: str
    workspace_dir: Path | None = None
    workspace_git: str | None = None
    setup: list[str] = field(default_factory=list)
    eval_command: str = "true"  # a task file must say its check (TaskLine); Python callers may leave it out
    eval_reward: str = "exit"  # exit | stdout
    timeouts: Timeouts = field(default_factory=Timeouts)
    harbor: HarborEval | None = None  # graded by its verifier instead (eval_command is then HARBOR_UNGRADED)
    limits: Limits = field(default_factory=Limits)  # the session's sandbox limits (sandbox/limits.py)
    judge: TaskJudge | None = None  # an LLM judge on top of the check (polar_mitm/judges/)
    meta: dict[str, Any] = field(
        default_factory=dict
    )  # family, swe, meta: what the line carries beside the task


def _git_source(value: Any) -> str | None:
    """A repository to clone; passed to git as one argument after `--`, so it cannot become an option.

    Only plain transports are accepted: a local path, scp-like `user@host:path`, or a URL whose scheme git handles
    itself (GIT_URL_SCHEMES). git reads `NAME::ADDRESS` (and a URL of any other scheme) as "run the remote helper
    git-remote-NAME": `ext::CMD` runs a command, `fd::3` talks over a file descriptor and waits forever.
    """
    if value is None:
        return None
    source = value
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in source):
        raise ValueError(f"workspace.git cannot contain control characters: {source!r}")
    if (helper := GIT_HELPER.match(source)) is not None:
        raise ValueError(
            f"workspace.git {source!r} names the git transport helper {helper.group(1)!r}::; "
            f"use a local path, scp-like user@host:path or a {'/'.join(GIT_URL_SCHEMES)} URL"
        )
    scheme = GIT_URL.match(source)
    if scheme is not None and scheme.group(1).lower() not in GIT_URL_SCHEMES:
        raise ValueError(
            f"workspace.git {source!r}: git would hand the scheme {scheme.group(1)!r} to a remote "
            f"helper; use a local path, scp-like user@host:path or a {'/'.join(GIT_URL_SCHEMES)} URL"
        )
    return source


# -- the schema of one line (pydantic: unknown fields refused, every field typed) --------------------------------


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("cannot contain a NUL character")
    return value


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _as_check(value: Any) -> Any:
    return {"command": value} if isinstance(value, str) else value


def _task_id(value: Any) -> Any:
    if (problem := id_problem(value)) is not None:
        raise ValueError(f"{problem}: {value!r}")
    return value


Text = Annotated[StrictStr, StringConstraints(min_length=1), AfterValidator(_no_nul)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)]


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkspaceSpec(_Schema):
    dir: Text | None = None  # copied per session; relative to the task file's folder
    git: Annotated[Text, AfterValidator(_git_source)] | None = None  # cloned per session instead
    setup: Annotated[list[Text], BeforeValidator(_as_list)] = []  # shell commands run in it first


def _absolute_path(value: str) -> str:
    if not value.startswith("/") or any(part in (".", "..") for part in value.split("/")):
        raise ValueError(f"must be an absolute path without '.' or '..' segments: {value!r}")
    return value


def check_reward_rule(value: str) -> str:
    """A Harbor reward rule, or a ValueError listing the rules."""
    if value in REWARD_RULES or (value.startswith("key:") and len(value) > len("key:")):
        return value
    raise ValueError(f"must be one of {', '.join(REWARD_RULES)} or key:NAME, not {value!r}")


REWARD_RULES = ("only", "mean", "min", "max", "sum")
# Why a Harbor task's [verifier].user / [agent].user cannot be honoured: a sandbox maps a single uid, and a named
# user's rights (root's capabilities, another user's files) do not exist in it.
USER_NOT_APPLIED = (
    "is not applied: every command of a session runs as its sandbox's one user (uid 1000, no capabilities)"
)


def _no_verifier_user(value: str) -> str:
    raise ValueError(f"{value!r} {USER_NOT_APPLIED}; remove it")


class HarborSpec(_Schema):
    """A Harbor task's verifier. Its timeout is `timeouts.eval`; relative folders are resolved like workspace.dir."""

    tests: Text  # the task's tests/ (test.sh and what it needs)
    solution: Text | None = None  # the task's solution/ (solve.sh), for `polar-mitm tasks check`
    workdir: Annotated[Text, AfterValidator(_absolute_path)] = "/app"  # the Dockerfile's WORKDIR
    env: dict[Annotated[Text, AfterValidator(_no_nul)], Annotated[StrictStr, AfterValidator(_no_nul)]] = {}
    # reward.txt is one number; reward.json names several: "only" (exactly one entry, else refused), "mean",
    # "min", "max", "sum" of them all, or "key:NAME" (that entry).
    reward_rule: Annotated[StrictStr, AfterValidator(check_reward_rule)] = "only"
    user: Annotated[Text, AfterValidator(_no_verifier_user)] | None = None  # [verifier].user: refused


class CheckSpec(_Schema):
    command: Text | None = None  # run in the session's workspace once the harness is done
    reward: Literal["exit", "stdout"] = "exit"
    harbor: HarborSpec | None = None  # or: a Harbor verifier grades the session

    @model_validator(mode="after")
    def _one_kind(self) -> CheckSpec:
        if (self.command is None) == (self.harbor is None):
            raise ValueError(
                "eval takes either command (a shell check) or harbor (a Harbor verifier), not "
                + ("both" if self.command is not None else "neither")
            )
        if self.harbor is not None and "reward" in self.model_fields_set:
            raise ValueError("eval.reward is for eval.command; a Harbor verifier writes its own reward file")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_kind(self, handler: Any) -> dict[str, Any]:
        # A command check dumps as it always did ({command, reward}): the service's converter compares fields.
        dumped = {key: value for key, value in handler(self).items() if value is not None}
        if self.harbor is not None:
            dumped.pop("reward", None)  # refused beside harbor: the dump must load again
        return dumped


class TimeoutsSpec(_Schema):
    init: Seconds = 120.0
    run: Seconds = 600.0
    eval: Seconds = 120.0


class TaskLine(_Schema):
    """One line of a task file. `eval` is required: a task without a check would reward every session alike."""

    task_id: Annotated[str, BeforeValidator(_task_id)]
    prompt: Text
    eval: Annotated[CheckSpec, BeforeValidator(_as_check)]
    workspace: WorkspaceSpec = WorkspaceSpec()
    timeouts: TimeoutsSpec = TimeoutsSpec()
    limits: LimitsSpec = (
        LimitsSpec()
    )  # memory_mb, pids, open_files, file_size_mb, tmp_mb, home_mb of its sandbox
    judge: JudgeSpec | None = None  # an LLM judge's reward on top of eval's (tasks/judge_spec.py)
    family: StrictStr | None = None  # written by `polar-mitm tasks generate`
    swe: dict[str, Any] | None = None  # written by `polar-mitm tasks swe`: the instance and its grading spec
    meta: dict[str, Any] | None = None  # your own data, kept with the task


MISSING_HELP = {
    "eval": "every task needs a check: a shell command run in the workspace after the session (its exit code is "
    'the reward, or with "reward": "stdout" the last number it prints); write "eval": "true" to reward every '
    "session 1.0 on purpose",
    "command": 'eval.command is the shell command that checks the session (or write "eval": "COMMAND")',
}


def schema_problem(exc: ValidationError) -> str:
    """A validation error's first problem as one line: where, what, and for an unknown field the likely one (a
    misspelt field is reported before the missing one it explains)."""
    error = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    names = [str(part) for part in error["loc"] if not isinstance(part, int)]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
    if error["type"] == "extra_forbidden":
        models = {
            "workspace": WorkspaceSpec,
            "eval": CheckSpec,
            "timeouts": TimeoutsSpec,
            "eval.harbor": HarborSpec,
            "limits": LimitsSpec,
            "judge": JudgeSpec,
        }
        model = models.get(".".join(names[:-1]), TaskLine)
        known = list(model.model_fields)
        given = names[-1].lower()
        close = [k for k in known if given.startswith(k) or k.startswith(given)]  # `evaluation`, `timeout`
        close = close or difflib.get_close_matches(given, known, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]!r}? " if close else ""
        own = '; put your own data under "meta"' if model is TaskLine else ""
        return f"unknown field {where!r}: {hint}the fields are {', '.join(known)}{own}"
    if error["type"] == "missing":
        return f"{where} is missing: {MISSING_HELP.get(names[-1], 'it is required')}"
    message = str(error["msg"]).removeprefix("Value error, ")
    return message if not where or message.startswith(where) else f"{where}: {message}"


def parse_task(raw: dict[str, Any], base: Path) -> Task:
    """One task from its JSON object; a ValueError names the field at fault."""
    if not isinstance(raw, dict):
        raise ValueError("a task must be a JSON object")
    try:
        line = TaskLine.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(schema_problem(exc)) from None
    workspace_dir = (base / line.workspace.dir).resolve() if line.workspace.dir else None
    if workspace_dir is not None and not workspace_dir.is_dir():
        raise ValueError(f"workspace.dir {line.workspace.dir!r} is not a folder ({workspace_dir})")
    harbor = _harbor_eval(line.eval.harbor, base) if line.eval.harbor is not None else None
    return Task(
        task_id=line.task_id,
        prompt=line.prompt,
        workspace_dir=workspace_dir,
        workspace_git=line.workspace.git,
        setup=list(line.workspace.setup),
        eval_command=line.eval.command if harbor is None else HARBOR_UNGRADED,
        eval_reward=line.eval.reward,
        timeouts=Timeouts(init=line.timeouts.init, run=line.timeouts.run, eval=line.timeouts.eval),
        harbor=harbor,
        limits=line.limits.limits(),
        judge=line.judge.judge() if line.judge is not None else None,
        meta={k: raw[k] for k in ("family", "swe", "meta") if raw.get(k) is not None},
    )


def _harbor_eval(spec: HarborSpec, base: Path) -> HarborEval:
    tests = (base / spec.tests).resolve()
    if not (tests / "test.sh").is_file():
        raise ValueError(f"eval.harbor.tests {spec.tests!r} holds no test.sh ({tests})")
    solution = (base / spec.solution).resolve() if spec.solution else None
    if solution is not None and not solution.is_dir():
        raise ValueError(f"eval.harbor.solution {spec.solution!r} is not a folder ({solution})")
    return HarborEval(
        tests=tests,
        workdir=spec.workdir,
        solution=solution,
        env=dict(spec.env),
        reward_rule=spec.reward_rule,
        user=spec.user,
    )


def load_tasks(path: str | Path) -> list[Task]:
    """Parse a JSONL task file; every error is a TaskFileError naming the file and line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TaskFileError(f"{path}: {exc.strerror or exc}") from exc
    tasks: list[Task] = []
    seen: set[str] = set()
    # Split bytes at \n only: str.splitlines would also split at U+2028 and friends, valid inside JSON strings.
    for lineno, raw_line in enumerate(data.split(b"\n"), 1):
        try:
            line = raw_line.decode("utf-8")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            task = parse_task(json.loads(line), path.parent)
        except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise TaskFileError(f"{path}:{lineno}: {exc}") from exc
        if task.task_id in seen:
            raise TaskFileError(f"{path}:{lineno}: duplicate task_id {task.task_id!r}")
        seen.add(task.task_id)
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: no tasks")
    return tasks
