"""A task-file line and a `TaskRequest` are the same task: one converter each way, so a task file can be submitted
to the service and a submitted task runs exactly as that line would under `polar-mitm rollout`.

    line                          TaskRequest
    task_id                       task_id
    prompt                        instruction
    eval {command, reward}        evaluator {strategy: command, config: {command, reward}}
    eval {harbor: {tests, …}}     evaluator {strategy: harbor, config: {tests, solution, workdir, env, …}}
    eval + judge {mode, …}        evaluator {strategy: rubric, config: {judge: {mode, …}, command, reward}}
                                  (or config: {judge, harbor: {…}}: a Harbor verifier's outcome, judged)
    workspace {dir, git, setup}   metadata.workspace
    limits {memory_mb, …}         metadata.limits
    timeouts {init, run, eval}    metadata.timeouts (timeout_seconds: their sum; without them, timeouts.run;
                                  metadata.agent_timeout, Polar's budget for the run, caps timeouts.run)
    family, swe, meta             metadata.family, metadata.swe, metadata.meta
    (the command's --harness, -g) agent.harness, num_samples

A request needs an evaluator, as a task line needs `eval`: a session nothing checks would be rewarded like any other.
A relative `workspace.dir` (and a Harbor verifier's `tests`, `solution`) is resolved against the service's task
root (`--task-root`), never the caller's folder. Polar's `runtime` (a container per session) has no task-line
field: every session runs in the service's own sandbox, so a request's runtime must be null or name that sandbox's
image (`check_runtime`).

Strategy `rubric` is a task with a `judge` (tasks/judge_spec.py): its outcome check (`config.command`, or
`config.harbor`) rewards the session as `command`/`harbor` would, then the service's judge (`serve-rollouts
--judge-url`) adds `weight · score` (service/judging.py). A rubric evaluator without a check has the outcome
`true` (1.0 for every session that finished): the judge alone tells the group's sessions apart.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from polar_mitm.service.models import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec, TaskRequest
from polar_mitm.tasks.task_file import Task, TaskLine, parse_task

CARRIED = ("family", "swe", "meta")  # a line's own data, kept under the request's metadata
IMAGE_SANDBOXES = ("docker", "podman")  # the sandboxes that run a container image: Polar's `docker` backend


class RequestError(ValueError):
    """A TaskRequest that cannot run as a task (the message names the field)."""


def line_to_request(
    line: dict[str, Any], harness: str, num_samples: int = 1, builder: str = "prefix_merging"
) -> TaskRequest:
    """The TaskRequest of one task-file line (checked as the task file checks it)."""
    checked = TaskLine.model_validate(line)
    timeouts = checked.timeouts.model_dump()
    metadata: dict[str, Any] = {
        "workspace": checked.workspace.model_dump(exclude_defaults=True),
        "timeouts": timeouts,
    }
    metadata.update({key: line[key] for key in CARRIED if line.get(key) is not None})
    if "limits" in line:
        metadata["limits"] = checked.limits.model_dump(exclude_defaults=True)
    if checked.judge is not None:
        check = checked.eval.model_dump()
        if checked.eval.harbor is not None:
            check = {"harbor": checked.eval.harbor.model_dump(exclude_defaults=True)}
        judge = checked.judge.model_dump(exclude_unset=True)
        evaluator = EvaluatorSpec(strategy="rubric", config={"judge": judge, **check})
    elif checked.eval.harbor is not None:
        evaluator = EvaluatorSpec(
            strategy="harbor", config=checked.eval.harbor.model_dump(exclude_defaults=True)
        )
    else:
        evaluator = EvaluatorSpec(config=checked.eval.model_dump())
    return TaskRequest(
        task_id=checked.task_id,
        instruction=checked.prompt,
        num_samples=num_samples,
        timeout_seconds=sum(timeouts.values()),
        agent=AgentSpec(harness=harness),
        builder=BuilderSpec(strategy=builder),
        evaluator=evaluator,
        metadata=metadata,
    )


def task_to_request(
    task: Task,
    harness: str,
    num_samples: int = 1,
    builder: str = "prefix_merging",
    *,
    task_id: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> TaskRequest:
    """The TaskRequest of a loaded task (its workspace folder absolute: the service must see the same files), under
    `task_id` when the caller needs its own (a loop's ids, unique per iteration); `metadata` is added."""
    workspace: dict[str, Any] = {}
    if task.workspace_dir is not None:
        workspace["dir"] = str(task.workspace_dir)
    if task.workspace_git is not None:
        workspace["git"] = task.workspace_git
    if task.setup:
        workspace["setup"] = list(task.setup)
    line: dict[str, Any] = {
        "task_id": task.task_id,
        "prompt": task.prompt,
        "eval": _task_eval(task),
        "limits": asdict(task.limits),
        "timeouts": {"init": task.timeouts.init, "run": task.timeouts.run, "eval": task.timeouts.eval},
        **({"workspace": workspace} if workspace else {}),
        **{key: task.meta[key] for key in CARRIED if task.meta.get(key) is not None},
        **({"judge": _task_judge(task)} if task.judge is not None else {}),
    }
    request = line_to_request(line, harness, num_samples, builder)
    update: dict[str, Any] = {"metadata": {**request.metadata, **(metadata or {})}}
    if task_id is not None:
        update["task_id"] = task_id
    return request.model_copy(update=update)


def _task_eval(task: Task) -> dict[str, Any]:
    """A loaded task's `eval` as its line said it (a Harbor verifier's folders absolute)."""
    if task.harbor is None:
        return {"command": task.eval_command, "reward": task.eval_reward}
    harbor = task.harbor
    spec: dict[str, Any] = {
        "tests": str(harbor.tests),
        "workdir": harbor.workdir,
        "reward_rule": harbor.reward_rule,
    }
    spec.update({"env": dict(harbor.env)} if harbor.env else {})
    spec.update({"solution": str(harbor.solution)} if harbor.solution else {})
    spec.update({"user": harbor.user} if harbor.user else {})
    return {"harbor": spec}


def _task_judge(task: Task) -> dict[str, Any]:
    """A loaded task's `judge` as its line said it (the fields its mode takes)."""
    judge = task.judge
    assert judge is not None
    spec: dict[str, Any] = {"mode": judge.mode, "weight": judge.weight}
    spec.update({"rubric": judge.rubric} if judge.rubric is not None else {})
    spec.update({"reference": judge.reference} if judge.reference is not None else {})
    spec.update({"scale": list(judge.scale)} if judge.mode == "rubric" else {})
    return spec


def _check(strategy: str, config: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """A command or harbor evaluator's `config` as a task line's `eval`."""
    if strategy == "harbor":
        if env:
            raise RequestError(
                "evaluator.env is not supported: a Harbor verifier's variables go in config.env"
            )
        return {"harbor": dict(config)}
    if env:
        raise RequestError("evaluator.env is not supported: put the variables in evaluator.config.command")
    unknown = set(config) - {"command", "reward"}
    if unknown or "command" not in config:
        raise RequestError(
            f"evaluator.config takes command (required) and reward (exit | stdout), not {sorted(unknown)}"
        )
    return dict(config)


def _rubric_check(config: dict[str, Any], env: dict[str, str]) -> tuple[dict[str, Any], Any]:
    """A rubric evaluator's (`eval`, `judge`): its outcome check (`command` and `reward`, or `harbor`; without
    one, `true`) and its judge (checked as a task line's `judge` is)."""
    unknown = set(config) - {"judge", "command", "reward", "harbor"}
    if unknown or "judge" not in config:
        raise RequestError(
            "evaluator.config of strategy rubric takes judge (required: {mode, rubric, weight, reference, "
            f"scale}}) and command, reward or harbor (the outcome check), not {sorted(unknown)}"
        )
    if "harbor" in config:
        if {"command", "reward"} & set(config):
            raise RequestError("evaluator.config takes either command (and reward) or harbor, not both")
        return _check("harbor", config["harbor"], env), config["judge"]
    outcome = {key: config[key] for key in ("command", "reward") if key in config}
    return _check("command", {"command": "true", **outcome}, env), config["judge"]


def request_to_line(request: TaskRequest) -> dict[str, Any]:
    """The task-file line of a TaskRequest; a RequestError names what no task line can say."""
    if request.evaluator is None:
        raise RequestError(
            "evaluator is required: {'strategy': 'command', 'config': {'command': CHECK}} (a session nothing "
            "checks would be rewarded like every other)"
        )
    evaluator, judge = request.evaluator, None
    if evaluator.strategy == "rubric":
        check, judge = _rubric_check(evaluator.config, evaluator.env)
    else:
        check = _check(evaluator.strategy, evaluator.config, evaluator.env)
    meta = request.metadata
    line: dict[str, Any] = {"task_id": request.task_id, "prompt": request.instruction, "eval": check}
    if judge is not None:
        line["judge"] = judge
    if meta.get("workspace"):
        line["workspace"] = meta["workspace"]
    timeouts = dict(meta.get("timeouts") or {"run": request.timeout_seconds})
    if request.agent_timeout is not None:  # Polar's budget for the run alone: the run stops at the sooner
        timeouts["run"] = min(float(timeouts.get("run") or request.agent_timeout), request.agent_timeout)
    line["timeouts"] = timeouts
    if meta.get("limits"):
        line["limits"] = meta["limits"]
    line.update({key: meta[key] for key in CARRIED if meta.get(key) is not None})
    return line


def request_task(request: TaskRequest, task_root: Path) -> Task:
    """The runnable Task of a request: its line, checked and resolved as a task file's would be."""
    try:
        return parse_task(request_to_line(request), task_root)
    except RequestError:
        raise
    except ValueError as exc:  # the task file's own message, naming the field
        raise RequestError(str(exc)) from None


def check_runtime(runtime: RuntimeSpec | None, sandbox: tuple[str, str | None]) -> None:
    """A RequestError naming the field unless `runtime` is null or asks for the service's own `sandbox` (kind,
    image): a docker runtime of the image `--sandbox docker|podman --image` runs, with Polar's defaults elsewhere."""
    if runtime is None:
        return
    kind, image = sandbox
    if unsupported := runtime.unsupported():
        raise RequestError(
            ", ".join(f"runtime.{name}" for name in unsupported)
            + ": not supported: each session runs in the "
            "service's sandbox as it was started (--sandbox, --image); send runtime: null, or only backend and image"
        )
    if runtime.backend != "docker" or kind not in IMAGE_SANDBOXES:
        raise RequestError(
            f"runtime: this service runs each session in --sandbox {kind}"
            + (f" --image {image}" if image else "")
            + f", not a {runtime.backend} container of {runtime.image}; send runtime: null, or start a service "
            f"with --sandbox docker|podman --image {runtime.image}"
        )
    if runtime.image != image:
        raise RequestError(
            f"runtime.image {runtime.image}: this service runs --image {image}; send runtime: null or that image, "
            f"or start a service with --image {runtime.image}"
        )
