"""What one sandboxed session may use: memory, processes, open files, file size and its private tmpfs sizes.

Why each limit sits where it does: memory and process count are the session cgroup's (`memory.max`, `pids.max`;
session_cgroup.py) because a process count set with RLIMIT_NPROC is ignored for root and counts every process of
the uid, not the session's; open files and file size are per-process rlimits (inherited, so they reach everything
the harness starts); /tmp and HOME are tmpfs mounts with a `--size`, so filling them fails with ENOSPC instead of
filling the host's disk. A task line may change any of them (`"limits": {…}`, `LimitsSpec`).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

MIB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """One session's limits (MiB and counts); the defaults fit every harness we run (node CLIs use ~1 GiB)."""

    memory_mb: int = 4096  # cgroup memory.max (v2) / memory.limit_in_bytes (v1)
    pids: int = 1024  # cgroup pids.max: processes and threads together (a fork bomb stops here)
    open_files: int = 4096  # RLIMIT_NOFILE
    file_size_mb: int = 2048  # RLIMIT_FSIZE: the largest file a session can write
    tmp_mb: int = 1024  # the private /tmp tmpfs
    home_mb: int = 512  # the private HOME tmpfs (harnesses without a prepared home)

    def rlimits(self) -> dict[int, int]:
        """The per-process limits, by `resource` constant."""
        return {
            resource.RLIMIT_NOFILE: self.open_files,
            resource.RLIMIT_FSIZE: self.file_size_mb * MIB,
        }

    def prlimit_argv(self) -> list[str]:
        """The rlimits as an argv prefix (util-linux `prlimit`, which sets them and execs the rest): lowered only,
        and with no Python between fork and exec (a spawn stays a vfork)."""
        names = {resource.RLIMIT_NOFILE: "--nofile", resource.RLIMIT_FSIZE: "--fsize"}
        argv = ["prlimit"]
        for which, value in self.rlimits().items():
            _soft, hard = resource.getrlimit(which)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            argv.append(f"{names[which]}={value}:{value}")
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
