"""What SWE grading puts right in the agent's workspace before the tests run, and how it keeps pytest to it.

Why: the agent owns the workspace, and much in it steers a test run besides the test files: a `conftest.py`, a
`pytest.py` (or `pytest/`) that `python -m pytest` would import instead of pytest, an ini file (`pytest.ini`,
`setup.cfg`, `pyproject.toml`, `tox.ini`, …) whose `addopts` loads a plugin, `sitecustomize`/`usercustomize`, `.pth`
files, planted bytecode (`__pycache__`, `*.pyc`), and its own `.git` (hooks, fsmonitor, filters, replace refs, a
`core.worktree` elsewhere) that the grader's git commands would obey. Each of those gave reward 1 with the bug
unfixed (issue 36 item 3). So, before `test_patch` is applied (`is_steering` has the names):

- every steering path (`is_steering`) is put back as it was at `base_commit`: one that exists there gets its
  base content, one that does not is removed (`restore_steering_paths`);
- every git command runs with the repository's hooks, fsmonitor, filters, replace refs, global and system
  configuration switched off, on the workspace's own `.git` directory and work tree (`git`);
- pytest is pointed at the configuration file inside the workspace, or at none, so an ini file planted above the
  workspace (the agent can write there too) is never read (`pytest_config_arguments`).

What this does not close: the code under test runs inside the test process, so a fix that also patches pytest's
reporting at import time is not caught here; nor are objects rewritten in `.git/objects` (git does not re-hash what
it reads). Running agents in a sandbox or container rules those out.
"""

from __future__ import annotations

import configparser
import logging
import os
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path, PurePosixPath

logger = logging.getLogger(__name__)

# Files that steer pytest anywhere in the workspace: conftest files, configuration files, bytecode caches.
STEERING_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.toml",
        ".pytest.toml",
        "pytest.ini",
        ".pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        ".gitattributes",
    }
)
STEERING_DIRS = frozenset({"__pycache__", ".pytest_cache"})
STEERING_SUFFIXES = (".pyc", ".pyo")
# What steers Python's start or stands in for pytest from the top of the workspace (the directory on sys.path when
# `python -m pytest` runs there): modules or packages of these names, .pth files, installed-package metadata. Only
# the top: deeper down, `src/_pytest/` is pytest's own source in the pytest repository, the agent's to fix.
SHADOWED_MODULES = frozenset({"pytest", "_pytest", "conftest", "sitecustomize", "usercustomize"})
MODULE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".so", ".pyd")
TOP_LEVEL_SUFFIXES = (".pth", ".dist-info", ".egg-info", ".egg-link")
# pytest's configuration files, in the order its `locate_config` tries them in one directory.
PYTEST_CONFIG_NAMES = (
    "pytest.toml",
    ".pytest.toml",
    "pytest.ini",
    ".pytest.ini",
    "pyproject.toml",
    "tox.ini",
    "setup.cfg",
)


class GradingError(RuntimeError):
    """Grading refused: a path escaping the workspace, a grading spec or environment changed since it was made."""


def path_problem(path: str) -> str | None:
    """Why `path` is not a plain relative path inside a repository's work tree, or None when it is."""
    if not path:
        return "is empty"
    if "\0" in path:
        return "contains a NUL character"
    if path.startswith('"'):
        return "is C-quoted (git's escapes could hide '..'); quoted paths are not supported"
    if path.startswith("/"):
        return "is absolute: it escapes the repository"
    parts = path.split("/")
    if ".." in parts:
        return "has a '..' component: it escapes the repository"
    if any(part in ("", ".") for part in parts):
        return "has an empty or '.' component"
    if any(part.lower() == ".git" for part in parts):
        return "is inside .git"
    if path.startswith("-"):
        return "starts with '-' (the test command would read it as an option)"
    return None


def workspace_entry(workspace: Path, path: str) -> Path:
    """Where `path` lies in the workspace, its directories' symlinks resolved, the entry not.

    Why: the agent owns the workspace and may have made a test directory (or one above it) a symlink to elsewhere;
    grading deletes and restores these paths, so a path whose directory resolves outside the workspace (or into
    its .git) is refused with a GradingError. The entry itself is returned unresolved: a symlink there is removed
    as a link, never followed.
    """
    if (problem := path_problem(path)) is not None:
        raise GradingError(f"test_patch path {path!r} {problem}")
    root = workspace.resolve()
    parent = (root / path).parent.resolve()
    if not parent.is_relative_to(root):
        raise GradingError(
            f"test_patch path {path!r} escapes the workspace: its directory resolves to {parent} "
            f"(a symlink in the workspace points outside it)"
        )
    if parent.relative_to(root).parts[:1] == (".git",):
        raise GradingError(f"test_patch path {path!r} resolves into the workspace's .git ({parent})")
    return parent / PurePosixPath(path).name


# -- git, without what the agent could have configured ---------------------------------------------------------------


def git_dir(workspace: Path) -> Path:
    """The workspace's `.git`, which must be a real directory in it (a gitfile or a link could point anywhere)."""
    dot_git = workspace.resolve() / ".git"
    if dot_git.is_symlink() or not dot_git.is_dir():
        raise GradingError(f"{dot_git} is not a directory: the workspace's repository was replaced")
    return dot_git


def git(
    workspace: Path, *args: str, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`git ARGS` on the workspace's repository with nothing the agent configured able to run or redirect it.

    Hooks (post-checkout runs on a file checkout), fsmonitor, smudge/clean filters and replace refs are off; the
    global and system configuration (the agent's user owns ~/.gitconfig) is not read; GIT_DIR and GIT_WORK_TREE
    name the workspace, so `core.worktree` or a gitfile cannot send the checkout elsewhere.
    """
    dot_git = git_dir(workspace)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_DIR=str(dot_git),
        GIT_WORK_TREE=str(workspace.resolve()),
        GIT_NO_REPLACE_OBJECTS="1",
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
    )
    overrides = [f"core.hooksPath={os.devnull}", "core.fsmonitor=false", f"core.attributesFile={os.devnull}"]
    overrides += ["core.sparseCheckout=false", "core.sparseCheckoutCone=false"]
    overrides += _driver_overrides(dot_git, env)
    with tempfile.TemporaryDirectory(prefix="polar-grading-index-") as scratch:
        # A fresh index: the agent's could hold skip-worktree or assume-unchanged flags that stop a checkout.
        env["GIT_INDEX_FILE"] = str(Path(scratch) / "index")
        return subprocess.run(
            ["git", "--literal-pathspecs", *(item for o in overrides for item in ("-c", o)), *args],
            cwd=workspace,
            env=env,
            input=input,
            text=True,
            capture_output=True,
            check=check,
        )


def _driver_overrides(dot_git: Path, env: dict[str, str]) -> list[str]:
    """Blank the repository configuration's filter and driver commands (git runs a smudge filter on checkout)."""
    listed = subprocess.run(
        ["git", "config", "--name-only", "--get-regexp", r"^(filter|diff|merge)\..*\."],
        cwd=dot_git,
        env=env,
        text=True,
        capture_output=True,
    )
    overrides = set()
    for key in listed.stdout.split():
        kind, _, rest = key.partition(".")
        driver, _, setting = rest.rpartition(".")
        if setting in ("smudge", "clean", "process", "textconv", "command", "driver"):
            overrides.add(f"{key}=")
        if kind == "filter":
            overrides.add(f"filter.{driver}.required=false")
    return sorted(overrides)


# -- steering files --------------------------------------------------------------------------------------------------


def is_steering(relative: str, is_dir: bool) -> bool:
    """Whether a workspace path steers pytest or Python's start (see the module docstring and the names above)."""
    name = PurePosixPath(relative).name
    if "/" not in relative:  # at the top of the workspace
        stem, suffix = name.split(".", 1)[0], os.path.splitext(name)[1]  # pytest.cpython-311-….so: "pytest"
        shadows = stem in SHADOWED_MODULES and (is_dir or suffix in MODULE_SUFFIXES or ".cpython-" in name)
        if shadows or name.endswith(TOP_LEVEL_SUFFIXES):
            return True
    if is_dir:
        return name in STEERING_DIRS
    return name in STEERING_NAMES or name.endswith(STEERING_SUFFIXES)


def present_steering_paths(workspace: Path) -> set[str]:
    """Steering paths now in the workspace (outside .git); a steering directory is one path, not descended."""
    found: set[str] = set()
    root = workspace.resolve()
    for folder, dirs, files in os.walk(root):  # does not follow links: a linked directory is listed as a name
        relative_folder = Path(folder).relative_to(root).as_posix()
        prefix = "" if relative_folder == "." else relative_folder + "/"
        if not prefix:
            dirs[:] = [d for d in dirs if d != ".git"]
        for name in list(dirs):
            if is_steering(prefix + name, is_dir=True):  # a link to a directory counts: imports follow it
                found.add(prefix + name)
                dirs.remove(name)
        found.update(prefix + name for name in files if is_steering(prefix + name, is_dir=False))
    return found


def base_steering_paths(workspace: Path, base_commit: str) -> set[str]:
    """Steering paths of `base_commit`'s tree: a file inside a steering directory counts as that directory."""
    listed = git(workspace, "ls-tree", "-r", "-z", "--name-only", "--full-tree", base_commit).stdout
    found: set[str] = set()
    for path in filter(None, listed.split("\0")):
        parts = path.split("/")
        top = next(
            (i for i in range(len(parts) - 1) if is_steering("/".join(parts[: i + 1]), is_dir=True)), None
        )
        if top is not None:
            found.add("/".join(parts[: top + 1]))
        elif is_steering(path, is_dir=False):
            found.add(path)
    return found


def restore_steering_paths(workspace: Path, base_commit: str) -> list[str]:
    """Put every steering path back as it is at `base_commit` (removed when it is not there); the paths changed.

    Every path is checked by `workspace_entry` before anything is removed: a GradingError means nothing was.
    """
    wanted = sorted(present_steering_paths(workspace) | base_steering_paths(workspace, base_commit))
    roots = [path for path in wanted if not any(path.startswith(other + "/") for other in wanted)]
    entries = [workspace_entry(workspace, path) for path in roots]
    for path, entry in zip(roots, entries, strict=True):
        # Always rewritten: the agent's index could mark a changed file unchanged (assume-unchanged).
        remove_entry(entry)
        if git(workspace, "cat-file", "-e", f"{base_commit}:{path}", check=False).returncode == 0:
            git(workspace, "checkout", "-q", base_commit, "--", path)
    if roots:
        logger.info("restored to base_commit or removed: %s", ", ".join(roots))
    return roots


def remove_entry(entry: Path) -> None:
    """Remove a file, a link (as a link) or a directory tree (rmtree does not follow links inside it)."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink(missing_ok=True)


# -- pytest's start ---------------------------------------------------------------------------------------------------

CWD_PLUGIN = "polar_grading_cwd"
CWD_PLUGIN_SOURCE = '''"""The test run's directory on sys.path, as `python -m pytest` has it, once pytest's plugins are loaded."""

import os
import sys

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config):
    sys.path.insert(0, os.getcwd())
'''


def write_cwd_plugin(folder: Path) -> Path:
    """Write the pytest plugin that puts the workspace on sys.path late; returns `folder`.

    Why: the tests' Python starts with the workspace off sys.path (PYTHONSAFEPATH), so that a `pytest.py`,
    `_pytest/` or `*.dist-info` entry point there cannot stand in for pytest or load a plugin; but tests of a
    repository that is not installed import it from the workspace, as `python -m pytest` lets them. pytest calls
    this hook after it has imported itself, the `-p` plugins and the installed ones, before any conftest.
    """
    (folder / f"{CWD_PLUGIN}.py").write_text(CWD_PLUGIN_SOURCE, encoding="utf-8")
    return folder


# -- pytest's configuration ------------------------------------------------------------------------------------------


def pytest_config_arguments(workspace: Path, test_paths: list[str]) -> list[str]:
    """The options that keep pytest's configuration search inside the workspace.

    pytest looks for its configuration from the tests' common directory upwards, past the workspace to `/`, and
    takes the first file that configures it: a `pytest.ini` the agent left in the folder above the workspace would
    load a plugin. So the grader names the file pytest would find inside the workspace (`-c FILE`), or, when there
    is none, no file at all (`-c /dev/null`) with pytest's own choice of rootdir (the nearest `setup.py`, else the
    workspace) and conftest cut-off.
    """
    root = workspace.resolve()
    chain = [*_upward(root, test_paths)]
    config = next((path for folder in chain for path in _configs(folder) if _configures_pytest(path)), None)
    if config is None:  # pytest 8+ falls back to the nearest pyproject.toml
        config = next(
            (folder / "pyproject.toml" for folder in chain if (folder / "pyproject.toml").is_file()), None
        )
    # Relative to the workspace, the test command's directory (also in a container, where it is mounted elsewhere).
    if config is not None:
        return ["-c", config.relative_to(root).as_posix()]
    rootdir = next((folder for folder in chain if (folder / "setup.py").is_file()), root)
    relative = rootdir.relative_to(root).as_posix()
    return ["-c", os.devnull, "--rootdir", relative, "--confcutdir", relative]


def _upward(root: Path, test_paths: list[str]) -> list[Path]:
    """The tests' common directory and its parents, up to the workspace."""
    existing = [root / path for path in test_paths if (root / path).exists()]
    common = Path(os.path.commonpath(existing)) if existing else root
    if common.is_file():
        common = common.parent
    return [folder for folder in (common, *common.parents) if folder.is_relative_to(root)]


def _configs(folder: Path) -> list[Path]:
    return [folder / name for name in PYTEST_CONFIG_NAMES if (folder / name).is_file()]


def _configures_pytest(path: Path) -> bool:
    """Whether pytest takes `path` as its configuration file (an unreadable one counts: pytest reports it)."""
    if path.name in ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini"):
        return True
    try:
        if path.suffix == ".toml":
            tool = tomllib.loads(path.read_text(encoding="utf-8")).get("tool", {})
            return isinstance(tool, dict) and "pytest" in tool
        parser = configparser.RawConfigParser(strict=False, interpolation=None)
        parser.read_string(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, configparser.Error):
        return True
    return parser.has_section("tool:pytest" if path.name == "setup.cfg" else "pytest")
