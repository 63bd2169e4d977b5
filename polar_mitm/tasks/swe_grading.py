"""Grading of SWE-bench-format tasks, run by the rollout's INIT (`env`) and POST-RUN (`grade`) stages:

    python -m polar_mitm.tasks.swe_grading env SPEC SHA256     # once per task: its venv (or its image), reused
    python -m polar_mitm.tasks.swe_grading grade SPEC SHA256   # in the workspace after the run; `reward: R` last

`grade` follows SWE-bench's evaluation script: the files that `test_patch` touches are restored to `base_commit`
(whatever the agent did to them), `test_patch` is applied, the test command runs on the test files of the patch in
the task's own environment, and the log goes through the `swebench` package: its log parser
(`harness.log_parsers`, `parse_log_pytest` by default), `get_logs_eval` (markers, and the exit-code cross-check that
catches a log claiming passes the run did not have), `get_eval_tests_report`, `get_resolution_status` and
`compute_fail_to_pass`. Reward: `resolved` → 1.0 when every FAIL_TO_PASS and PASS_TO_PASS test passes;
`fraction` → the share of FAIL_TO_PASS fixed when every PASS_TO_PASS test still passes, else 0.0.

The environment: a venv per task (`env_dir`, created once under a file lock by the first INIT of the task, then
reused by its other sessions), or the instance's Docker/Apptainer image with the workspace mounted at
`container_workdir` (SWE-bench's images: /testbed with a `testbed` conda env).

What the agent can reach: it runs as the same user as grading, so nothing outside its workspace is out of its reach
by permissions alone (files made read-only here stop accidents, not an agent that runs chmod). So grading trusts
nothing the agent could have changed unless it can check it:
- the workspace: every path grading deletes or restores is resolved first and refused when it leaves the
  workspace (`workspace_entry`); a symlink at a test path is removed as a link, never followed; every file that
  steers pytest or Python's start (conftest.py, pytest.py, ini files, sitecustomize, .pth, bytecode) is put back as
  at `base_commit`, git runs without the repository's hooks and filters, pytest's configuration search stops at
  the workspace, and the tests' Python starts without the workspace on sys.path (`swe_workspace`);
- the grader itself runs as `python -P -m …`, so a `polar_mitm/` or `swebench/` in the workspace is not imported;
- the spec (outside the workspace, in `<tasks>.swe/`) is pinned by its sha256 on the command line: the task file
  holds the digest and the rollout read the task file before any agent ran, so a spec changed since
  `polar-mitm tasks swe` wrote it is refused rather than graded with (it names the test command and the venv);
- the venv (outside the workspace, `<tasks>.swe/envs/` by default) is shared by the task's sessions, so an agent
  could change it for the sessions after it. It cannot be pinned the same way (INIT builds it, possibly on another
  machine, after the task file is written), so INIT records a digest of every file and link in it and grading
  refuses a venv that no longer matches (INIT rebuilds one); an agent that rewrote the venv *and* the record would
  pass, which only running agents as another user or in a container (`--image`) rules out.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.tasks.swe_workspace import (
    CWD_PLUGIN,
    GradingError,
    git,
    path_problem,
    pytest_config_arguments,
    remove_entry,
    restore_steering_paths,
    workspace_entry,
    write_cwd_plugin,
)

READY_MARK = ".polar-env-ready"
# The test run's Python: the workspace is not put on sys.path at start (a workspace pytest.py would be imported for
# `python -m pytest`), no bytecode is written, no user site; and whatever PYTHON*/PYTEST_* the caller had is dropped.
ISOLATED_PYTHON = {"PYTHONSAFEPATH": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}
UNTRUSTED_ENV = ("PYTHON", "PYTEST_", "VIRTUAL_ENV", "PY_")


@dataclass
class GradingSpec:
    """Everything grading needs for one task; written by `polar-mitm tasks swe`, outside the workspace."""

    instance_id: str
    base_commit: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    test_command: str = "python -m pytest -rA --tb=no -p no:cacheprovider"
    log_parser: str = "parse_log_pytest"
    reward: str = "resolved"  # resolved | fraction
    env_dir: str = ""
    requirements: list[str] = field(default_factory=list)
    python: str = sys.executable
    image: str | None = None
    container: str = "docker"  # docker | apptainer
    container_workdir: str = "/testbed"
    container_setup: str = ""

    def save(self, path: Path) -> str:
        """Write the spec read-only (replacing any older one); returns its sha256, which the task file keeps."""
        data = json.dumps(asdict(self), indent=1).encode("utf-8")
        with tempfile.NamedTemporaryFile(
            "wb", dir=path.parent, prefix=f".{path.name}.", delete=False
        ) as handle:
            handle.write(data)
        os.chmod(handle.name, 0o444)
        os.replace(handle.name, path)
        return hashlib.sha256(data).hexdigest()

    @classmethod
    def load(cls, path: Path, sha256: str | None = None) -> GradingSpec:
        """The spec at `path`; with `sha256`, a GradingError unless the file is exactly the one written."""
        data = Path(path).read_bytes()
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise GradingError(
                f"the grading spec {path} changed since `polar-mitm tasks swe` wrote it "
                f"(sha256 {hashlib.sha256(data).hexdigest()[:12]}…, expected {sha256[:12]}…)"
            )
        return cls(**json.loads(data.decode("utf-8")))


@dataclass
class Grade:
    """The outcome of one grading."""

    reward: float
    resolution: str  # swebench's RESOLVED_FULL | RESOLVED_PARTIAL | RESOLVED_NO, or why nothing was graded
    fixed: int = 0  # FAIL_TO_PASS tests that pass
    kept: int = 0  # PASS_TO_PASS tests that pass
    failing: list[str] = field(default_factory=list)  # graded tests that do not pass

    def lines(self, spec: GradingSpec) -> list[str]:
        shown = ", ".join(self.failing[:10]) + (" …" if len(self.failing) > 10 else "")
        return [
            f"{spec.instance_id}: {self.resolution}",
            f"FAIL_TO_PASS fixed {self.fixed}/{len(spec.fail_to_pass)}, "
            f"PASS_TO_PASS kept {self.kept}/{len(spec.pass_to_pass)}",
            *([f"not passing: {shown}"] if self.failing else []),
            f"reward: {self.reward:g}",
        ]  # last: the rollout reads the last number printed


# -- swebench ------------------------------------------------------------------------------------------------------


def swebench_harness() -> types.ModuleType:
    """`swebench.harness`, without running its package __init__.

    Why: that __init__ imports docker_utils, modal_eval and reporting (docker, modal, datasets): ~10 s per grading.
    Grading needs only `constants`, `log_parsers` and `grading`, which import nothing heavy; a bare package object
    with the real search path lets them load as usual.
    """
    if "swebench.harness" not in sys.modules:
        import swebench

        location = importlib.util.find_spec("swebench.harness", swebench.__path__)
        if location is None or location.submodule_search_locations is None:
            raise ImportError("swebench.harness not found: install polar-mitm[swe]")
        package = types.ModuleType("swebench.harness")
        package.__path__ = list(location.submodule_search_locations)
        package.__package__ = "swebench.harness"
        sys.modules["swebench.harness"] = package
    import swebench.harness.grading  # noqa: F401 — loads constants and log_parsers too

    return sys.modules["swebench.harness"]


def log_parser(name: str) -> Any:
    """swebench's log parser of that name (`parse_log_pytest`, …); a ValueError lists the known ones."""
    registry = swebench_harness().log_parsers.PARSER_REGISTRY
    if name not in registry:
        raise ValueError(f"unknown log parser {name!r}; swebench has {', '.join(sorted(registry))}")
    return registry[name]


def patched_files(patch: str) -> list[str]:
    """The files a diff touches (paths in the repository), parsed with unidiff as swebench does.

    Every path the diff names (old and new side) must be a plain path inside the repository (`path_problem`):
    grading deletes and restores these paths, so `/etc/x`, `../x` or `.git/hooks/x` are refused here, when the
    instance is loaded, and again by grading itself.
    """
    from unidiff import PatchSet
    from unidiff.errors import UnidiffParseError

    try:
        patched = PatchSet(patch)
    except UnidiffParseError as exc:
        raise ValueError(f"not a unified diff: {exc}") from None
    files = []
    for patched_file in patched:
        for named in (patched_file.source_file, patched_file.target_file):
            if named != "/dev/null" and (problem := path_problem(_repository_path(named))) is not None:
                raise ValueError(f"path {_repository_path(named)!r} {problem}")
        path = patched_file.source_file if patched_file.is_removed_file else patched_file.target_file
        files.append(_repository_path(path))
    if not files:
        raise ValueError("the diff touches no file")
    return files


def _repository_path(named: str) -> str:
    """A diff's file name without its `a/` or `b/` prefix."""
    return named[2:] if named.startswith(("a/", "b/")) else named


def suite_directives(spec: GradingSpec) -> list[str]:
    """What the test command runs: the test files of `test_patch` (swebench skips data files such as .json)."""
    non_test = tuple(swebench_harness().constants.NON_TEST_EXTS)
    return [path for path in patched_files(spec.test_patch) if not path.endswith(non_test)]


# -- the environment -------------------------------------------------------------------------------------------------


def prepare_env(spec: GradingSpec) -> str:
    """INIT: the task's environment, created once (later sessions find it ready); what was done, in words."""
    if spec.image:
        return _prepare_image(spec)
    env = Path(spec.env_dir)
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.with_name(env.name + ".lock"), "w") as lock:
        fcntl.flock(
            lock, fcntl.LOCK_EX
        )  # one INIT builds it; the others of the same task wait, then reuse it
        changes = env_changes(env) if (env / READY_MARK).exists() else None
        if (env / READY_MARK).exists() and changes is None:
            return f"reusing {env}"
        done = f"rebuilt {env}: {changes}" if changes else f"created {env}"
        shutil.rmtree(env, ignore_errors=True)  # a half-built one from an interrupted INIT, or a changed one
        _build_venv(env, spec)
        _seal_env(env, spec)
    return done


def env_digest(env: Path) -> str:
    """sha256 over every file (content, executable bit), link (target) and directory of a venv, in path order."""
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(env):  # does not follow links: a linked directory is listed as a link
        dirs.sort()
        for name in sorted([*dirs, *files]):
            path = Path(folder) / name
            relative = path.relative_to(env).as_posix()
            if relative == READY_MARK:
                continue
            if path.is_symlink():
                entry = f"L {relative} -> {os.readlink(path)}"
            elif path.is_dir():
                entry = f"D {relative}"
            else:
                with open(path, "rb") as handle:
                    content = hashlib.file_digest(handle, "sha256").hexdigest()
                entry = f"F {relative} {os.access(path, os.X_OK):d} {content}"
            digest.update(entry.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


def _seal_env(env: Path, spec: GradingSpec) -> None:
    """After a build: its files read-only (directories stay writable, so `rm -rf` works), its digest recorded."""
    for folder, _, files in os.walk(env):
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink():
                path.chmod(path.stat().st_mode & ~0o222)
    (env / READY_MARK).write_text(json.dumps({"requirements": spec.requirements, "sha256": env_digest(env)}))


def env_changes(env: Path) -> str | None:
    """None when the venv is as INIT built it; else what differs, in words."""
    try:
        recorded = json.loads((env / READY_MARK).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{env / READY_MARK} is missing or has no digest"
    return None if env_digest(env) == recorded else "its files changed since INIT built it"


def _build_venv(env: Path, spec: GradingSpec) -> None:
    """A venv with the test requirements; uv installs from its cache offline when it can (fast, no network)."""
    uv = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv:
        _check([uv, "venv", "-q", "--python", spec.python, str(env)])
        if spec.requirements:
            base = [uv, "pip", "install", "-q", "--python", str(env / "bin" / "python"), *spec.requirements]
            if subprocess.run([*base, "--offline"], capture_output=True).returncode != 0:
                _check(base)
        return
    _check([spec.python, "-m", "venv", str(env)])
    if spec.requirements:
        _check([str(env / "bin" / "python"), "-m", "pip", "install", "-q", *spec.requirements])


def _prepare_image(spec: GradingSpec) -> str:
    assert spec.image is not None
    if spec.container == "apptainer":
        sif = Path(spec.env_dir) / "image.sif"
        if not sif.exists():
            sif.parent.mkdir(parents=True, exist_ok=True)
            _check(["apptainer", "build", str(sif), f"docker://{spec.image}"])
        return f"image {sif}"
    if subprocess.run(["docker", "image", "inspect", spec.image], capture_output=True).returncode != 0:
        _check(["docker", "pull", "-q", spec.image])
    return f"image {spec.image}"


def _check(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(
            f"`{shlex.join(argv)}` failed ({done.returncode}): {(done.stdout + done.stderr)[-800:]}"
        )


def check_env(spec: GradingSpec, workspace: Path) -> None:
    """A GradingError unless the task's venv lies outside the workspace and is as INIT built it."""
    if spec.image:
        return  # the tests run in the image; the workspace is all the container gets
    env = Path(spec.env_dir).resolve()
    if env.is_relative_to(workspace.resolve()):
        raise GradingError(
            f"the task's environment {env} is inside the workspace, where the agent could change it"
        )
    if (changes := env_changes(env)) is not None:
        raise GradingError(f"the task's environment {env}: {changes}; the next INIT of the task rebuilds it")


def suite_argv(
    spec: GradingSpec, workspace: Path, plugin_dir: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    """The test run: the command on the patch's test files, in the venv or in the instance's container.

    With `plugin_dir` (a folder of the grader's own, outside the workspace) a `python -m pytest` command in the
    venv gets the workspace on sys.path back, as `-m` gives it, but only after pytest and its plugins loaded
    (`swe_workspace.write_cwd_plugin`).
    """
    directives = suite_directives(spec)
    form = _pytest_form(spec.test_command)
    pinned = pytest_config_arguments(workspace, directives) if form else []
    if form == "module" and plugin_dir is not None and not spec.image:
        pinned = ["-p", CWD_PLUGIN, *pinned]
    command = " ".join([spec.test_command, *map(shlex.quote, [*pinned, *directives])])
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(UNTRUSTED_ENV) and k not in ("BASH_ENV", "ENV")
    }
    if CWD_PLUGIN in pinned:
        env["PYTHONPATH"] = str(plugin_dir)  # that folder holds the plugin and nothing else
    if spec.image:
        script = f"{spec.container_setup} && {command}" if spec.container_setup else command
        script = f"export {' '.join(f'{k}={v}' for k, v in ISOLATED_PYTHON.items())} && {script}"
        mount = f"{workspace}:{spec.container_workdir}"
        if spec.container == "apptainer":
            image = str(Path(spec.env_dir) / "image.sif")
            return [
                "apptainer",
                "exec",
                "--containall",
                "--bind",
                mount,
                "--pwd",
                spec.container_workdir,
                image,
                "bash",
                "-c",
                script,
            ], env
        return [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            "-v",
            mount,
            "-w",
            spec.container_workdir,
            spec.image,
            "bash",
            "-c",
            script,
        ], env
    bin_dir = Path(spec.env_dir) / "bin"
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=spec.env_dir, **ISOLATED_PYTHON
    )
    return ["bash", "-c", command], env


def _pytest_form(test_command: str) -> str | None:
    """How the test command runs pytest: "module" (`python -m pytest`), "script" (`pytest`), or None (not pytest,
    or it names its configuration itself: then its configuration search is left alone)."""
    try:
        words = shlex.split(test_command)
    except ValueError:
        return None
    if any(word in ("-c", "--config-file", "--rootdir") or word.startswith("--rootdir=") for word in words):
        return None
    if any(word == "pytest" and words[i - 1] == "-m" for i, word in enumerate(words) if i):
        return "module"
    return "script" if any(Path(word).name in ("pytest", "py.test") for word in words) else None


# -- grading ---------------------------------------------------------------------------------------------------------


def restore_and_apply_test_patch(spec: GradingSpec, workspace: Path) -> str | None:
    """Put the test files back as they were at `base_commit`, then apply `test_patch`; None, or why it failed.

    Every path is checked by `workspace_entry` before anything is touched; a GradingError means nothing was.
    """
    try:
        paths = patched_files(spec.test_patch)
    except ValueError as exc:
        raise GradingError(f"test_patch: {exc}") from None
    entries = [workspace_entry(workspace, path) for path in paths]
    restore_steering_paths(workspace, spec.base_commit)  # conftest.py, pytest.py, ini files, bytecode, …
    for path, entry in zip(paths, entries, strict=True):
        if git(workspace, "cat-file", "-e", f"{spec.base_commit}:{path}", check=False).returncode == 0:
            remove_entry(entry)  # written afresh: never through a link, whatever the agent's index says
            git(workspace, "checkout", "-q", spec.base_commit, "--", path)
        else:  # a file the patch creates: whatever the agent put there goes
            remove_entry(entry)
    applied = git(workspace, "apply", "-v", "-", input=spec.test_patch, check=False)
    return None if applied.returncode == 0 else f"test_patch does not apply: {applied.stderr.strip()[-500:]}"


def grade(spec: GradingSpec, workspace: Path) -> Grade:
    """Restore tests, apply test_patch, run the tests, grade them with swebench."""
    harness = swebench_harness()
    constants, grading = harness.constants, harness.grading
    problem = restore_and_apply_test_patch(spec, workspace)
    if problem is not None:
        print(problem)
        return Grade(0.0, constants.APPLY_PATCH_FAIL)
    check_env(spec, workspace)
    with tempfile.TemporaryDirectory(prefix="polar-grading-") as plugin_dir:
        argv, env = suite_argv(spec, workspace, write_cwd_plugin(Path(plugin_dir)))
        run = subprocess.run(
            argv,
            cwd=workspace,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
    log = (
        f"{constants.START_TEST_OUTPUT}\n{run.stdout}\n{constants.END_TEST_OUTPUT}\n"
        f"{constants.TEST_EXIT_CODE}: {run.returncode}\n"
    )
    status_map, ran = _logs_eval(spec, log)
    if not ran:
        print(run.stdout[-3000:])
        return Grade(0.0, "TESTS_DID_NOT_RUN", failing=list(spec.fail_to_pass))
    report = grading.get_eval_tests_report(
        status_map, {constants.FAIL_TO_PASS: spec.fail_to_pass, constants.PASS_TO_PASS: spec.pass_to_pass}
    )
    f2p, p2p = report[constants.FAIL_TO_PASS], report[constants.PASS_TO_PASS]
    resolution = grading.get_resolution_status(report)
    if spec.reward == "fraction":
        reward = float(grading.compute_fail_to_pass(report)) if not p2p["failure"] else 0.0
    else:
        reward = 1.0 if resolution == constants.ResolvedStatus.FULL.value else 0.0
    return Grade(
        reward,
        resolution,
        fixed=len(f2p["success"]),
        kept=len(p2p["success"]),
        failing=[*f2p["failure"], *p2p["failure"]],
    )


def _logs_eval(spec: GradingSpec, log: str) -> tuple[dict[str, str], bool]:
    """swebench's get_logs_eval on our log (it reads a file): the status map, and whether the tests really ran."""
    from swebench.types import TestSpec

    test_spec = TestSpec(
        instance_id=spec.instance_id,
        image=spec.image or "",
        eval_script_list=[],
        repo="",
        version="",
        FAIL_TO_PASS=spec.fail_to_pass,
        PASS_TO_PASS=spec.pass_to_pass,
        log_parser=spec.log_parser,
    )
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as handle:
        handle.write(log)
    try:
        return swebench_harness().grading.get_logs_eval(test_spec, handle.name)
    finally:
        os.unlink(handle.name)


def main(argv: list[str] | None = None) -> int:
    """`env SPEC` or `grade SPEC` (in the workspace); `grade` always ends with a `reward:` line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3) or args[0] not in ("env", "grade"):
        print("usage: python -m polar_mitm.tasks.swe_grading {env|grade} SPEC [SHA256]", file=sys.stderr)
        return 2
    sha256 = args[2] if len(args) == 3 else None
    if args[0] == "env":
        print(prepare_env(GradingSpec.load(Path(args[1]), sha256)))
        return 0
    try:
        spec = GradingSpec.load(Path(args[1]), sha256)
    except Exception as exc:  # noqa: BLE001 — an unusable spec is a zero reward too
        print(f"grading failed: {type(exc).__name__}: {exc}\nreward: 0", flush=True)
        return 0
    try:
        result = grade(spec, Path.cwd())
    except Exception as exc:  # noqa: BLE001 — any failure is a zero reward with its reason, never a stray number
        print(f"grading failed: {type(exc).__name__}: {exc}")
        result = Grade(0.0, "GRADING_ERROR", failing=list(spec.fail_to_pass))
    with contextlib.suppress(BrokenPipeError):
        print("\n".join(result.lines(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
