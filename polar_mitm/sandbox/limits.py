"""What one sandboxed session may use: memory, processes, open files, file size and its private tmpfs sizes.

Why each limit sits where it does: memory and process count are the session cgroup's (`memory.max`, `pids.max`;
session_cgroup.py) wherever one can be made, because only a cgroup bounds the session as a whole. Open files and
file size are per-process rlimits (inherited, so they reach everything the harness starts); /tmp and HOME are tmpfs
mounts with a `--size`, so filling them fails with ENOSPC instead of filling the host's disk. A task line may
change any of them (`"limits": {…}`, `LimitsSpec`).

Without a cgroup (none writable, or `POLAR_SESSION_CGROUPS=off`) memory and processes fall back to rlimits, which are
weaker, and say so in recipes/sandboxes.md:

- memory: RLIMIT_DATA (heap and private writable mappings) per process, not the session's total. Not RLIMIT_AS:
  runtimes reserve address space they never use (gemini-cli's WebAssembly fails to start under an RLIMIT_AS of
  16 GiB, measured), so an address-space bound breaks harnesses while DATA bounds what they allocate.
- processes: RLIMIT_NPROC, set inside the sandbox (bwrap.py), where it counts the session's own user namespace,
  not every process of the host uid. The kernel does not apply it when the sandbox user is root outside (bwrap run
  by root maps the sandbox's uid to root): there, without a cgroup, a session's process count is unbounded.
"""

from __future__ import annotations

import resource
import shutil
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

MIB = 1024 * 1024
PRLIMIT_FLAGS = {  # util-linux prlimit's option of each rlimit we set
    resource.RLIMIT_NOFILE: "--nofile",
    resource.RLIMIT_FSIZE: "--fsize",
    resource.RLIMIT_DATA: "--data",
    resource.RLIMIT_NPROC: "--nproc",
}


@dataclass(frozen=True)
class Limits:
    """One session's limits (MiB and counts); the defaults fit every harness we run (node CLIs use ~1 GiB)."""

    memory_mb: int = 4096  # cgroup memory.max (v2) / memory.limit_in_bytes (v1); no cgroup: RLIMIT_DATA
    pids: int = 1024  # cgroup pids.max: processes and threads together; no cgroup: RLIMIT_NPROC
    open_files: int = 4096  # RLIMIT_NOFILE
    file_size_mb: int = 2048  # RLIMIT_FSIZE: the largest file a session can write
    tmp_mb: int = 1024  # the private /tmp tmpfs
    home_mb: int = 512  # the private HOME tmpfs (harnesses without a prepared home)

    def rlimits(self, memory: bool = True) -> dict[int, int]:
        """The per-process limits set before the sandbox starts, by `resource` constant; `memory`: the RLIMIT_DATA
        fallback too (no cgroup holds the session's memory)."""
        found = {resource.RLIMIT_NOFILE: self.open_files, resource.RLIMIT_FSIZE: self.file_size_mb * MIB}
        if memory:
            found[resource.RLIMIT_DATA] = self.memory_mb * MIB
        return found

    def prlimit_argv(self, memory: bool = True) -> list[str]:
        """The rlimits as an argv prefix (util-linux `prlimit`, which sets them and execs the rest): lowered only,
        and with no Python between fork and exec (a spawn stays a vfork). `memory=False` where the session's cgroup
        holds its memory."""
        return _prlimit(self.rlimits(memory))

    def process_limit_argv(self) -> list[str]:
        """RLIMIT_NPROC as an argv prefix, for the first command inside a sandbox's own user namespace (where it
        counts that session's processes), where no cgroup holds the session's process count."""
        return _prlimit({resource.RLIMIT_NPROC: self.pids})


def _prlimit(limits: dict[int, int]) -> list[str]:
    argv = [shutil.which("prlimit") or "prlimit"]  # its path: inside a sandbox PATH is the launch's
    for which, value in limits.items():
        _soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        argv.append(f"{PRLIMIT_FLAGS[which]}={value}:{value}")
    return [*argv, "--"]


class LimitsSpec(BaseModel):
    """A task line's `limits` object: any of Limits' fields, each a positive whole number."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mb: int = Field(default=Limits.memory_mb, gt=0, strict=True)
    pids: int = Field(default=Limits.pids, gt=0, strict=True)
    open_files: int = Field(default=Limits.open_files, gt=0, strict=True)
    file_size_mb: int = Field(default=Limits.file_size_mb, gt=0, strict=True)
    tmp_mb: int = Field(default=Limits.tmp_mb, gt=0, strict=True)
    home_mb: int = Field(default=Limits.home_mb, gt=0, strict=True)

    def limits(self) -> Limits:
        return Limits(**self.model_dump())
