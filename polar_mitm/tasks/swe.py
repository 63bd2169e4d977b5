"""SWE-bench / SWE-Gym instances as rollout tasks (`polar-mitm tasks swe INSTANCES -o tasks.jsonl`).

One instance (a row of a SWE-bench-format JSONL or Parquet file: `instance_id`, `repo`, `base_commit`,
`problem_statement`, `test_patch`, `FAIL_TO_PASS`, `PASS_TO_PASS`, optional `patch`, `version`, `hints_text`, …)
becomes one task of the rollout's task file (polar_mitm/tasks/task_file.py):

    workspace  the repository cloned from a mirror directory or a git URL, checked out at `base_commit`, its other
               refs and history beyond `base_commit` removed (a later commit would hold the fix)
    prompt     the problem statement in a template the user can change ({problem_statement}, {repo}, …)
    setup      INIT prepares the task's test environment once (a venv per task, or pulls the image) and reuses it
    eval       `python -m polar_mitm.tasks.swe_grading grade SPEC`: restores the test files, applies
               `test_patch`, runs the tests, grades them with swebench's parser and grading rules → reward

What grading needs but the agent must not see (test_patch, the test lists) goes to one JSON spec per task in
`<tasks>.swe/`, next to the task file, outside every workspace; the task's commands carry its sha256, so grading
refuses a spec changed after this wrote it (see swe_grading's docstring for what else grading checks). Every path
`test_patch` names must be a plain path inside the repository: an absolute, `..` or `.git` path fails the load.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.harness.base import id_problem
from polar_mitm.tasks.swe_grading import GradingSpec, patched_files

REQUIRED_TEXT = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch")
OPTIONAL_TEXT = ("patch", "version", "hints_text", "environment_setup_commit", "created_at")
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
REPO = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
DEFAULT_PROMPT = """\
You are working in a checkout of the repository {repo} (the current directory). Resolve this issue:

{problem_statement}

Change the repository's non-test source files so that the issue is fixed. Do not change the tests."""
PROMPT_FIELDS = ("problem_statement", "repo", "instance_id", "base_commit", "hints_text", "version")
IMAGE_FIELDS = ("instance_id", "docker_id", "repo", "org", "name", "version")


class InstanceError(ValueError):
    """An instance file row that cannot become a task; the message names the file, line, instance and field."""


@dataclass
class Instance:
    """One SWE-bench-format instance, validated."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    extra: dict[str, Any] = field(default_factory=dict)  # patch, version, hints_text, … (kept as given)

    @property
    def docker_id(self) -> str:
        """SWE-bench's image-name form of the id (`django__django-11099` → `django_1776_django-11099`)."""
        return self.instance_id.lower().replace("__", "_1776_")


def parse_instance(raw: Any) -> Instance:
    """One instance from its row; a ValueError names the field at fault."""
    if not isinstance(raw, dict):
        raise ValueError("an instance must be a JSON object")
    for name in REQUIRED_TEXT:
        if name not in raw or raw[name] is None:
            raise ValueError(f"missing field {name}")
        if not isinstance(raw[name], str) or not raw[name].strip():
            raise ValueError(f"field {name} must be a non-empty string")
    if (problem := id_problem(raw["instance_id"])) is not None:
        raise ValueError(f"field instance_id {problem}")
    if not REPO.match(raw["repo"]):
        raise ValueError(f"field repo must be OWNER/NAME, got {raw['repo']!r}")
    if not COMMIT.match(raw["base_commit"]):
        raise ValueError(f"field base_commit must be a hex commit id, got {raw['base_commit']!r}")
    for name in OPTIONAL_TEXT:
        if raw.get(name) is not None and not isinstance(raw[name], str):
            raise ValueError(f"field {name} must be a string")
    try:
        patched_files(raw["test_patch"])
    except ValueError as exc:
        raise ValueError(f"field test_patch: {exc}") from None
    fail_to_pass = _test_list(raw, "FAIL_TO_PASS")
    if not fail_to_pass:
        raise ValueError("field FAIL_TO_PASS is empty: an instance needs at least one test to fix")
    known = set(REQUIRED_TEXT) | {"FAIL_TO_PASS", "PASS_TO_PASS"}
    return Instance(
        instance_id=raw["instance_id"],
        repo=raw["repo"],
        base_commit=raw["base_commit"],
        problem_statement=raw["problem_statement"],
        test_patch=raw["test_patch"],
        fail_to_pass=fail_to_pass,
        pass_to_pass=_test_list(raw, "PASS_TO_PASS"),
        extra={k: v for k, v in raw.items() if k not in known},
    )


def _test_list(raw: dict[str, Any], name: str) -> list[str]:
    """A list of test ids; SWE-bench's files store it as a JSON string of the list."""
    if name not in raw or raw[name] is None:
        raise ValueError(f"missing field {name}")
    value = raw[name]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"field {name} must be a list of test ids or a JSON string of one") from None
    if hasattr(value, "tolist"):  # a numpy array, as pandas reads Parquet list columns
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise ValueError(f"field {name} must be a list of test ids (non-empty strings)")
    return value


def load_instances(path: str | Path) -> list[Instance]:
    """Instances from a .jsonl/.json (list) or .parquet file; every error is an InstanceError with its place."""
    path = Path(path)
    rows = _rows(path)
    instances: list[Instance] = []
    seen: set[str] = set()
    for where, raw in rows:
        name = raw.get("instance_id") if isinstance(raw, dict) else None
        label = f"{path}:{where}: instance {name!r}" if isinstance(name, str) else f"{path}:{where}"
        try:
            instance = parse_instance(raw)
        except ValueError as exc:
            raise InstanceError(f"{label}: {exc}") from None
        if instance.instance_id in seen:
            raise InstanceError(f"{label}: duplicate instance_id")
        seen.add(instance.instance_id)
        instances.append(instance)
    if not instances:
        raise InstanceError(f"{path}: no instances")
    return instances


def _rows(path: Path) -> list[tuple[str, Any]]:
    """(where, row) pairs: `where` is a line number (JSONL) or a row index (Parquet, JSON list)."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return [(f"row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
        data = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InstanceError(f"{path}: cannot read: {exc}") from None
    if path.suffix == ".json":
        try:
            rows = json.loads(data)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{path}: not JSON: {exc}") from None
        if not isinstance(rows, list):
            raise InstanceError(f"{path}: a .json instance file must hold a list of instances")
        return [(f"row {i}", row) for i, row in enumerate(rows)]
    out: list[tuple[str, Any]] = []
    for lineno, line in enumerate(data.split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append((str(lineno), json.loads(line)))
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{path}:{lineno}: not JSON: {exc}") from None
    return out


# -- instances → tasks --------------------------------------------------------------------------------------------


@dataclass
class SweOptions:
    """How instances become tasks (the `polar-mitm tasks swe` options)."""

    repos: Path | None = (
        None  # mirror directory: REPOS/OWNER__NAME, REPOS/OWNER/NAME, REPOS/NAME (+ .git, .bundle)
    )
    git_url: str = "https://github.com/{repo}.git"  # when there is no mirror
    prompt_template: str = DEFAULT_PROMPT
    test_command: str = "python -m pytest -rA --tb=no -p no:cacheprovider"
    log_parser: str = "parse_log_pytest"
    reward: str = "resolved"  # resolved: 1.0 when every test passes | fraction: share of FAIL_TO_PASS fixed
    image: str | None = None  # image pattern, e.g. swebench/sweb.eval.x86_64.{docker_id}:latest
    container: str = "docker"  # docker | apptainer
    container_workdir: str = "/testbed"
    container_setup: str = "source /opt/miniconda3/bin/activate && conda activate testbed"
    requirements: list[str] = field(default_factory=lambda: [_pytest_requirement()])
    env_root: Path | None = None  # per-task venvs (default: <tasks>.swe/envs)
    keep_history: bool = False
    timeouts: dict[str, float] = field(default_factory=lambda: {"init": 600, "run": 1800, "eval": 900})

    def check(self) -> None:
        """Refuse bad options before any file is written."""
        if self.reward not in ("resolved", "fraction"):
            raise ValueError(f"--reward must be 'resolved' or 'fraction', got {self.reward!r}")
        if self.container not in ("docker", "apptainer"):
            raise ValueError(f"--container must be 'docker' or 'apptainer', got {self.container!r}")
        _check_template(self.prompt_template, PROMPT_FIELDS, "prompt template")
        if self.image:
            _check_template(self.image, IMAGE_FIELDS, "--image")
        from polar_mitm.tasks.swe_grading import log_parser

        log_parser(self.log_parser)


def _pytest_requirement() -> str:
    """The pytest of this environment, pinned: a per-task venv then installs from the local cache, offline."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"pytest=={version('pytest')}"
    except PackageNotFoundError:
        return "pytest"


def _check_template(template: str, allowed: tuple[str, ...], what: str) -> None:
    """A str.format template may only name the fields we fill in."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"{what}: {exc} (write literal braces as {{{{ and }}}})") from None
    unknown = sorted(n for n in names if n not in allowed)
    if unknown:
        raise ValueError(f"{what}: unknown placeholder(s) {unknown}; known: {', '.join(allowed)}")


def repository_source(instance: Instance, options: SweOptions) -> str:
    """Where INIT clones the repository from: a mirror under --repos when there is one, else the git URL."""
    if options.repos is not None:
        org, name = instance.repo.split("/")
        for candidate in (f"{org}__{name}", f"{org}/{name}", name):
            for suffix in ("", ".git", ".bundle"):
                path = options.repos / (candidate + suffix)
                if path.exists():
                    return str(path.resolve())
        raise InstanceError(
            f"instance {instance.instance_id!r}: no mirror of {instance.repo} under {options.repos} "
            f"(looked for {org}__{name}, {org}/{name}, {name}, with .git/.bundle)"
        )
    return options.git_url.format(repo=instance.repo)


def checkout_commands(base_commit: str, keep_history: bool) -> list[str]:
    """INIT: check out `base_commit`; unless `keep_history`, drop every other ref and unreachable object.

    Why: a clone holds the repository's later commits (one of them is the fix) and, for a bundle of several
    instances, the other instances' trees. After this only `base_commit` and its ancestors remain.
    """
    commands = [f"git -c advice.detachedHead=false checkout -q --detach {base_commit}"]
    if not keep_history:
        # --no-deref: a symbolic ref (refs/remotes/origin/HEAD) goes itself, not the branch it points to.
        commands.append(
            "git remote remove origin 2>/dev/null; "
            "git for-each-ref --format='delete %(refname)' | git update-ref --no-deref --stdin"
            " && git reflog expire --expire=now --all && git gc -q --prune=now"
        )
    commands.append("git checkout -q -B main")
    return commands


def grading_spec(instance: Instance, options: SweOptions, env_root: Path) -> GradingSpec:
    """What the grader needs for one instance (kept out of the workspace)."""
    image = None
    if options.image:
        org, name = instance.repo.split("/")
        image = options.image.format(
            instance_id=instance.instance_id,
            docker_id=instance.docker_id,
            repo=instance.repo,
            org=org,
            name=name,
            version=instance.extra.get("version") or "",
        )
    return GradingSpec(
        instance_id=instance.instance_id,
        base_commit=instance.base_commit,
        test_patch=instance.test_patch,
        fail_to_pass=instance.fail_to_pass,
        pass_to_pass=instance.pass_to_pass,
        test_command=options.test_command,
        log_parser=options.log_parser,
        reward=options.reward,
        env_dir=str(env_root / env_dir_name(instance.instance_id)),
        requirements=list(options.requirements),
        python=sys.executable,
        image=image,
        container=options.container,
        container_workdir=options.container_workdir,
        container_setup=options.container_setup,
    )


def env_dir_name(instance_id: str) -> str:
    """A directory name for the task's environment: readable, and unique even when ids differ only in odd chars."""
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", instance_id)[:80]
    return f"{readable}-{hashlib.sha256(instance_id.encode()).hexdigest()[:8]}"


def instance_task(
    instance: Instance, options: SweOptions, spec_path: Path, spec_sha256: str
) -> dict[str, Any]:
    """The task-file object of one instance (tasks.py format); its commands pin the spec by its sha256."""
    # -P: the workspace (the command's cwd) is not on sys.path, so a polar_mitm/ or swebench/ there is not imported.
    grader = f"{shlex.quote(sys.executable)} -P -m polar_mitm.tasks.swe_grading"
    spec_arguments = f"{shlex.quote(str(spec_path))} {spec_sha256}"
    org, name = instance.repo.split("/")
    fields = {
        "problem_statement": instance.problem_statement,
        "repo": instance.repo,
        "instance_id": instance.instance_id,
        "base_commit": instance.base_commit,
        "hints_text": instance.extra.get("hints_text") or "",
        "version": instance.extra.get("version") or "",
    }
    setup = [*checkout_commands(instance.base_commit, options.keep_history), f"{grader} env {spec_arguments}"]
    return {
        "task_id": instance.instance_id,
        "prompt": options.prompt_template.format(**fields),
        "workspace": {"git": repository_source(instance, options), "setup": setup},
        "eval": {"command": f"{grader} grade {spec_arguments}", "reward": "stdout"},
        "timeouts": options.timeouts,
        "swe": {
            "instance_id": instance.instance_id,
            "repo": instance.repo,
            "org": org,
            "name": name,
            "base_commit": instance.base_commit,
            "spec": str(spec_path),
            "spec_sha256": spec_sha256,
        },
    }


def write_tasks(instances: list[Instance], options: SweOptions, out: Path) -> list[dict[str, Any]]:
    """Write the task file `out` and the grading specs in `<out>.swe/`; returns the task objects."""
    options.check()
    out = out.resolve()
    spec_dir = out.with_name(out.stem + ".swe")
    env_root = (options.env_root or spec_dir / "envs").resolve()
    spec_dir.mkdir(parents=True, exist_ok=True)
    tasks = []
    for instance in instances:
        spec_path = spec_dir / f"{env_dir_name(instance.instance_id)}.json"
        digest = grading_spec(instance, options, env_root).save(spec_path)
        tasks.append(instance_task(instance, options, spec_path, digest))
    out.write_text("".join(json.dumps(task) + "\n" for task in tasks), encoding="utf-8")
    return tasks
