"""What every sandbox kind is given for one session (`SessionBox`) and the interface each kind implements.

Why one interface: the runner starts the agent and the evaluation the same way whatever the kind is; a kind only
turns (argv, env, cwd) into the command line that runs it confined (`Sandbox.wrap`), so `none`, `bwrap` and the
container engines are picked once by the registry (`polar_mitm.sandbox.get_sandbox`) and no `if kind == …`
reaches the runner. `wrap` is pure (it builds argv), so a kind's contract is tested on the command line it builds;
the tunnel (tunnel.py) is the one thing that lives while the session runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from polar_mitm.sandbox.limits import Limits
from polar_mitm.sandbox.mounts import Mount
from polar_mitm.sandbox.tunnel import SOCKETS_INSIDE, GatewayTunnel, launcher_script

HOME_INSIDE = Path("/home/sandbox")  # the private HOME of a session without a prepared one
SANDBOX_ARGV0 = "polar-sandbox"  # $0 of the launcher script (what `ps` shows inside)


class SandboxUnavailable(RuntimeError):
    """The sandbox kind asked for cannot run on this machine (a user error: one line, exit 2)."""


@dataclass
class SessionBox:
    """One session's sandbox: its workspace (read-write at `workspace_inside`), what else it may see, its gateway
    ports (none: no network at all) and its limits. `home` is a prepared HOME to bind read-write (a preset's
    config files); without one the session gets a private tmpfs HOME. `held_by_cgroup` names the limits
    ("memory", "pids") the session's cgroup enforces; the others fall back to rlimits (limits.py)."""

    workspace: Path
    workspace_inside: Path | None = None
    home: Path | None = None
    readable: list[Path] = field(default_factory=list)  # single files or folders, read-only at their own path
    ports: list[int] = field(default_factory=list)
    sockets: Path | None = None  # the tunnel's host folder, bound at SOCKETS_INSIDE
    limits: Limits = field(default_factory=Limits)
    binds: list[Mount] = field(default_factory=list)  # more, at paths of their own (a grader's /tests, /logs)
    held_by_cgroup: frozenset[str] = frozenset()  # set by the one who limits the session's cgroup

    @property
    def inside(self) -> Path:
        return self.workspace_inside or self.workspace

    def relocate(self, text: str) -> str:
        """A host path in a launch (argv, env) as the sandbox sees it: the workspace may sit elsewhere inside."""
        if self.workspace_inside is None or self.workspace_inside == self.workspace:
            return text
        return text.replace(str(self.workspace), str(self.workspace_inside))

    def mounts(self) -> list[Mount]:
        """The session's own binds: its workspace and HOME read-write, the extra readable paths read-only."""
        found = [Mount(self.workspace, self.inside, writable=True)]
        if self.home is not None:
            found.append(Mount(self.home, self.home, writable=True))
        found += [Mount(p, p) for p in self.readable if p.exists()]
        if self.sockets is not None:
            found.append(Mount(self.sockets, SOCKETS_INSIDE, writable=True))
        return found + self.binds


class Sandbox:
    """A sandbox kind: `check` once per rollout, then `wrap` per process (the agent, the evaluation)."""

    kind: ClassVar[str]
    confines: ClassVar[bool] = True  # False only for `none`

    def check(self) -> None:
        """Raise SandboxUnavailable (with what to do) when this kind cannot run here."""

    def wrap(
        self, box: SessionBox, argv: list[str], env: dict[str, str], cwd: Path
    ) -> tuple[list[str], dict[str, str]]:
        """(host argv, host env) that run `argv` with `env` in `cwd` inside the sandbox `box` describes."""
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def session(self, box: SessionBox) -> AsyncIterator[SessionBox]:
        """The session's lifetime: its gateway tunnel runs while the body does (none without ports)."""
        if not box.ports or not self.confines:
            yield box
            return
        async with GatewayTunnel(box.ports) as tunnel:
            box.sockets = tunnel.folder
            try:
                yield box
            finally:
                box.sockets = None

    # -- shared by the kinds that confine ------------------------------------------------------------------------

    @staticmethod
    def inner_command(box: SessionBox, argv: list[str]) -> list[str]:
        """What runs inside: the launcher (forwarders up, then the harness) when the session has ports."""
        argv = [box.relocate(a) for a in argv]
        if not box.ports:
            return argv
        return ["bash", "-c", launcher_script(box.ports), SANDBOX_ARGV0, *argv]

    @staticmethod
    def inner_env(box: SessionBox, env: dict[str, str]) -> dict[str, str]:
        """The environment inside: the launch's own (never the host's), HOME private, TMPDIR the private /tmp."""
        inner = {k: box.relocate(v) for k, v in env.items()}
        if box.home is None:
            inner["HOME"] = str(HOME_INSIDE)
        inner["TMPDIR"] = "/tmp"
        return inner
