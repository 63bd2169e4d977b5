"""`--sandbox podman|docker --image IMAGE`: the same contract in a container, for machines with a container engine.

The same contract as bwrap: no network but the gateway (`--network none` and the Unix-socket tunnel), the
workspace read-write and the harness installs read-only at their own paths, a private /tmp, capabilities dropped,
limits as the engine's own flags (`--memory`, `--pids-limit`, `--ulimit`), the container removed with the session
(`--rm`, `--init` reaps what the harness left). The image must hold bash and socat.

podman runs for real where scripts/setup-podman.sh has made its root file system (rootful, runc on a hybrid cgroup
machine; tests/sandbox/test_podman.py, skipped where it is missing). docker is tested on the command line it builds
only (tests/sandbox/test_choosing_a_sandbox.py): these machines run no docker engine.
"""

from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path

from polar_mitm.sandbox.base import HOME_INSIDE, Sandbox, SandboxUnavailable, SessionBox
from polar_mitm.sandbox.bwrap import SANDBOX_UID
from polar_mitm.sandbox.limits import MIB
from polar_mitm.sandbox.mounts import toolchain_mounts

HYBRID_CGROUPS = Path("/sys/fs/cgroup/unified")  # v2 mounted beside the v1 hierarchies
UNPRIVILEGED_BASE = 100_000  # host uids the container's root and system users map to (rootful podman)


class Container(Sandbox):
    """A container engine's `run` (podman and docker take the same flags for all this uses)."""

    def __init__(self, kind: str, image: str | None) -> None:
        self.kind = kind  # type: ignore[misc]  # one class for both engines
        self.image = image

    def check(self) -> None:
        if not self.image:
            raise SandboxUnavailable(f"--sandbox {self.kind} needs --image IMAGE (one with bash and socat)")
        if self.kind == "docker" and Path(self.image).is_dir():
            raise SandboxUnavailable(
                f"--image {self.image}: a root file system folder needs --sandbox podman (docker wants an image)"
            )
        if shutil.which(self.kind) is None:
            raise SandboxUnavailable(
                f"--sandbox {self.kind}: {self.kind} is not installed; use --sandbox bwrap"
            )

    def wrap(
        self, box: SessionBox, argv: list[str], env: dict[str, str], cwd: Path
    ) -> tuple[list[str], dict[str, str]]:
        inner = self.inner_env(box, env)
        args = [shutil.which(self.kind) or self.kind, *self._runtime(), "run"]
        args += [
            "--rm",
            "--init",
            "--network",
            "none",
            "--cap-drop",
            "ALL",
        ]
        args += [
            "--security-opt",
            "no-new-privileges",
            "--read-only",
            "--user",
            f"{SANDBOX_UID}:{SANDBOX_UID}",
        ]
        args += self._user_namespace()
        args += ["--memory", f"{box.limits.memory_mb}m", "--pids-limit", str(box.limits.pids)]
        args += ["--ulimit", f"nofile={box.limits.open_files}:{box.limits.open_files}"]
        # The engine's own default would raise the process limit, which a container of ours may not (no
        # CAP_SYS_RESOURCE; runc and crun both refused it here): the session's process bound, lowered only.
        hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        nproc = box.limits.pids if hard == resource.RLIM_INFINITY else min(hard, box.limits.pids)
        args += ["--ulimit", f"nproc={nproc}:{nproc}"]
        fsize = box.limits.file_size_mb * MIB
        args += ["--ulimit", f"fsize={fsize}:{fsize}"]
        args += ["--tmpfs", f"/tmp:rw,size={box.limits.tmp_mb}m"]
        if box.home is None:
            args += ["--tmpfs", f"{HOME_INSIDE}:rw,size={box.limits.home_mb}m"]
        for mount in [*toolchain_mounts(), *box.mounts()]:
            args += ["-v", f"{mount.host}:{mount.inside}:{'rw' if mount.writable else 'ro'}"]
        args += ["-w", box.relocate(str(cwd))]
        for name, value in sorted(inner.items()):
            args += ["-e", f"{name}={value}"]
        # A folder is a root file system (debootstrap's, when no registry is reachable): podman's --rootfs.
        image = ["--rootfs", str(self.image)] if Path(str(self.image)).is_dir() else [str(self.image)]
        return [*args, *image, *self.inner_command(box, argv)], {"PATH": os.environ.get("PATH", os.defpath)}

    def _user_namespace(self) -> list[str]:
        """Rootful podman: the session's user is this process's own uid outside (as bwrap maps it), so the
        workspace is its to write, and the container's root is an unprivileged uid of the host."""
        if self.kind != "podman" or os.geteuid() != 0:
            return []
        maps = []
        for flag in ("--uidmap", "--gidmap"):
            maps += [flag, f"0:{UNPRIVILEGED_BASE}:{SANDBOX_UID}", flag, f"{SANDBOX_UID}:0:1"]
        return maps

    def _runtime(self) -> list[str]:
        """podman's OCI runtime: runc on a hybrid cgroup machine, where crun (its default) refuses to start
        ("cgroups in hybrid mode not supported", tried here), when runc is installed."""
        if self.kind == "podman" and HYBRID_CGROUPS.is_dir() and shutil.which("runc"):
            return ["--runtime", "runc"]
        return []
