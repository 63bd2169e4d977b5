"""Which host paths a sandboxed session sees: an allow-list, never the host's `/` with holes masked in it.

Why an allow-list: a mask list must name every secret (a token file, another session's workspace, a checkpoint,
the run directory), and whatever it forgets is readable; an allow-list shows only what a harness needs to run:
the system (`/usr`, `/etc`, `/opt` and the `/bin`, `/lib*` links), the toolchains the harness runs on (the Python
a venv was made from — under `/root/.pyenv` here, the rest of `/root` stays out), and the project's harness installs
(`.venv*`, `.harness-*`, `node_modules/`, and the `polar_mitm/` source, which the editable install imports: the
SDK agent runs `python -m polar_mitm.agent.cli`). All of these are bound read-only at their own paths, so every
absolute path in a launch (a venv's interpreter, a CLI in node_modules/.bin) means the same inside.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
SYSTEM_DIRS = ("/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


@dataclass(frozen=True)
class Mount:
    """One host path shown inside: read-only unless `writable`; `inside` defaults to the same path."""

    host: Path
    inside: Path
    writable: bool = False


def system_mounts() -> tuple[list[Mount], list[tuple[str, str]]]:
    """The system directories to bind read-only, and the ones that are symlinks here (`/bin -> usr/bin` on
    merged-/usr systems) as (link, target) pairs to recreate as links."""
    binds, links = [], []
    for name in SYSTEM_DIRS:
        path = Path(name)
        if path.is_symlink():
            links.append((name, str(path.readlink())))
        elif path.is_dir():
            binds.append(Mount(path, path))
    return binds, links


@functools.cache
def toolchain_mounts(repo: Path = REPO_ROOT) -> tuple[Mount, ...]:
    """The project's harness installs and the interpreters their venvs were made from, read-only (found once)."""
    found: list[Path] = [repo / "polar_mitm", repo / "node_modules"]
    found += sorted(p for p in repo.glob(".venv*") if p.is_dir())
    found += sorted(p for p in repo.glob(".harness-*") if p.is_dir())
    prefixes = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}
    for venv in [p for p in found if p.name.startswith(".venv")]:
        prefixes |= _venv_base(venv)
    found += sorted(prefixes)
    return tuple(Mount(p, p) for p in _outermost(p for p in found if p.exists() and not _is_system(p)))


def _venv_base(venv: Path) -> set[Path]:
    """The Python installation a venv's `pyvenv.cfg` names (`home = …/bin`): its interpreter lives there."""
    try:
        lines = (venv / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "home" and value.strip():
            return {Path(value.strip()).resolve().parent}
    return set()


def _is_system(path: Path) -> bool:
    return any(path == Path(d) or Path(d) in path.parents for d in SYSTEM_DIRS)


def _outermost(paths) -> list[Path]:
    """Each path once, and none inside another one already listed (binding both would be redundant)."""
    chosen: list[Path] = []
    for path in sorted(set(paths), key=lambda p: len(p.parts)):
        if not any(c == path or c in path.parents for c in chosen):
            chosen.append(path)
    return chosen
