"""A control group per harness session: every process the session starts is found and stopped with it.

Why: the environment marker (`processes.children.HARNESS_RUN_ENV`) is the agent's to remove, and a process
group is left with `setsid` — `env -u POLAR_HARNESS_RUN setsid daemon &` outlived its rollout (issue 36). A
process cannot leave its cgroup by forking, re-grouping or clearing its environment; the harness joins its
session's group before it execs (`join_argv`), so everything it starts is born inside. At the end `stop` kills
the whole group: cgroup v2's `cgroup.kill` (one write, atomic against forks), else v1's `pids` controller with
new forks refused first.

Where no cgroup file system is writable (a container without it, not root), or `POLAR_SESSION_CGROUPS=off` asks
for none (to run as such a machine does), `SessionCgroups.open` says so once and sessions fall back to the process
group and the marker, and their memory and process limits to rlimits (sandbox/limits.py). What stays open without
a sandbox: a process running as root can write its own pid into another cgroup's `cgroup.procs`; the sandbox's PID
namespace closes that.

Limits (`SessionCgroup.limit`): a sandboxed session's memory and process count are its group's (`memory.max`,
`pids.max`). Where the v2 group lacks those controllers (a hybrid machine: v2 for the kill, v1 for the rest), the
session also joins a group of its own in each v1 `memory` and `pids` hierarchy that is writable.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MOUNTS = Path("/proc/self/mounts")
# "off": no session cgroups in this process (as on a machine without them); unset or "auto": where writable.
CGROUPS_ENV = "POLAR_SESSION_CGROUPS"


@dataclass(frozen=True)
class SessionCgroup:
    """One session's group: `path` is its directory in the cgroup file system; `v2` says which kind."""

    path: Path
    v2: bool
    v1_limits: tuple[
        Path, ...
    ] = ()  # its groups in v1 memory/pids hierarchies, where v2 lacks those controllers

    def join_argv(self) -> list[str]:
        """How a process joins this group: an argv prefix, a shell that writes itself into the group's
        `cgroup.procs` files, then execs the rest (so the program, and all it starts, is born inside). Not a
        `preexec_fn`: Python code between fork and exec makes the spawn a full fork of this process, 7–14 ms with
        the event loop stopped (measured), where a plain spawn is a vfork."""
        procs_files = [str(p / "cgroup.procs") for p in (self.path, *self.v1_limits)]
        # "0": the writing process itself. A group it may not join after all is passed over: the process group and
        # the marker still find what it starts.
        joins = "".join(f'echo 0 2>/dev/null >"${i}"; ' for i in range(1, len(procs_files) + 1))
        return ["/bin/sh", "-c", f'{joins}shift {len(procs_files)}; exec "$@"', "polar-session", *procs_files]

    def limit(self, memory_bytes: int, pids: int) -> frozenset[str]:
        """Bound the group's memory and process count where a file for it is writable; which of "memory" and
        "pids" are bounded (the others are left to the rlimit fallback, sandbox/limits.py)."""
        wanted = {
            "memory.max": str(memory_bytes),
            "memory.limit_in_bytes": str(memory_bytes),
            "memory.swap.max": "0",
            "pids.max": str(pids),
        }
        done = []
        for folder in (self.path, *self.v1_limits):
            for name, value in wanted.items():
                target = folder / name
                if target.exists():
                    try:
                        target.write_text(value)
                        done.append(name)
                    except OSError as exc:
                        log.debug("cannot set %s: %s", target, exc)
        held = {"memory"} if {"memory.max", "memory.limit_in_bytes"} & set(done) else set()
        return frozenset(held | ({"pids"} if "pids.max" in done else set()))

    def pids(self) -> list[int]:
        try:
            return [int(line) for line in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def stop(self, timeout: float = 5.0) -> int:
        """SIGKILL every process still in the group and remove it; how many there were."""
        found = self.pids()
        if found:
            if self.v2 and (self.path / "cgroup.kill").exists():
                (self.path / "cgroup.kill").write_text("1")
            else:
                with contextlib.suppress(OSError):  # no new forks while the loop below kills
                    (self.path / "pids.max").write_text("0")
            deadline = time.monotonic() + timeout
            while (left := self.pids()) and time.monotonic() < deadline:
                for pid in left:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.02)
        # A killed process leaves its group's procs list before the kernel lets the group go: rmdir answers EBUSY
        # until its parent (init, for a daemon that left its session) has reaped it. Seen on CI's hybrid machine.
        deadline = time.monotonic() + timeout
        for folder in (*self.v1_limits, self.path):
            while True:
                try:
                    folder.rmdir()
                except OSError as e:
                    if e.errno == errno.EBUSY and time.monotonic() < deadline:
                        time.sleep(0.02)
                        continue
                break
        return len(found)


class SessionCgroups:
    """The rollout's parent group (`polar-mitm-PID` under this process's own cgroup) and one child per session."""

    def __init__(self, root: Path | None, v2: bool, v1_limit_roots: tuple[Path, ...] = ()) -> None:
        self.root, self.v2, self.v1_limit_roots = root, v2, v1_limit_roots

    @classmethod
    def open(cls) -> SessionCgroups:
        """A parent group where one can be made (cgroup v2, else v1 `pids`) and `CGROUPS_ENV` allows; else one that
        makes none."""
        wanted = os.environ.get(CGROUPS_ENV) or "auto"
        if wanted == "off":
            log.warning(
                "%s=off: no session cgroups; memory and process limits fall back to rlimits", CGROUPS_ENV
            )
            return cls(None, False)
        if wanted != "auto":
            log.warning(
                "%s=%r is neither 'off' nor 'auto': cgroups are used where writable", CGROUPS_ENV, wanted
            )
        for v2, where in ((True, _v2_home()), (False, _v1_pids_home())):
            if where is None:
                continue
            root = where / f"polar-mitm-{os.getpid()}"
            try:
                root.mkdir(exist_ok=True)
                probe = root / "probe"
                probe.mkdir(exist_ok=True)
                probe.rmdir()
            except OSError:
                continue
            return cls(root, v2, _v1_limit_roots(root) if v2 else _v1_limit_roots(root, ("memory",)))
        log.info(
            "no writable cgroup file system: a session's processes are found by process group and marker, its "
            "memory and process count bounded by rlimits"
        )
        return cls(None, False)

    def new(self, name: str) -> SessionCgroup | None:
        if self.root is None:
            return None
        path = self.root / name
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            log.warning("no cgroup for session %s: %s", name, exc)
            return None
        limits = []
        for parent in self.v1_limit_roots:
            with contextlib.suppress(OSError):
                (parent / name).mkdir(exist_ok=True)
                limits.append(parent / name)
        return SessionCgroup(path, self.v2, tuple(limits))

    def close(self) -> None:
        """Stop what is left in every session group and remove the parent."""
        if self.root is None:
            return
        for child in self.root.iterdir() if self.root.is_dir() else []:
            if child.is_dir():
                limits = tuple(p / child.name for p in self.v1_limit_roots if (p / child.name).is_dir())
                SessionCgroup(child, self.v2, limits).stop()
        for folder in (*self.v1_limit_roots, self.root):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _mount_points() -> list[tuple[str, Path, set[str]]]:
    try:
        lines = MOUNTS.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 4:
            found.append((parts[2], Path(parts[1].replace("\\040", " ")), set(parts[3].split(","))))
    return found


def _own_cgroup(controller: str | None) -> str | None:
    """This process's cgroup path in the v2 hierarchy (controller None) or in v1's `controller`."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (controller is None and controllers == "") or (controller in controllers.split(",")):
            return path
    return None


def _v2_home() -> Path | None:
    own = _own_cgroup(None)
    for kind, mount, _ in _mount_points():
        if kind == "cgroup2" and own is not None:
            return mount / own.lstrip("/")
    return None


def _v1_pids_home() -> Path | None:
    return _v1_home("pids")


def _v1_home(controller: str) -> Path | None:
    own = _own_cgroup(controller)
    for kind, mount, options in _mount_points():
        if kind == "cgroup" and controller in options and own is not None:
            return mount / own.lstrip("/")
    return None


def _v1_limit_roots(root: Path, controllers: tuple[str, ...] = ("memory", "pids")) -> tuple[Path, ...]:
    """Parent groups (named like `root`) in the v1 hierarchies of the limit controllers the v2 group lacks."""
    try:
        have = set((root / "cgroup.controllers").read_text().split())
    except OSError:
        have = set()
    found = []
    for controller in controllers:
        home = None if controller in have else _v1_home(controller)
        if home is None:
            continue
        try:
            (home / root.name).mkdir(exist_ok=True)
        except OSError:
            continue
        found.append(home / root.name)
    return tuple(found)


_this_process: list[SessionCgroups] = []


def for_sessions() -> SessionCgroups:
    """This process's parent group, made at the first session (and removed when the process exits)."""
    if not _this_process:
        import atexit

        _this_process.append(SessionCgroups.open())
        atexit.register(_this_process[0].close)
    return _this_process[0]


def group_name(session_id: str) -> str:
    """A cgroup directory name for any session id (ids may hold characters a file name should not)."""
    import hashlib

    return "s-" + hashlib.sha256(session_id.encode()).hexdigest()[:20]
