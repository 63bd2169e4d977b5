"""`--sandbox bwrap` (the default): each session in bubblewrap's namespaces, started in milliseconds.

Why bubblewrap: it needs no daemon, no image and no root filesystem of its own — the host's system is bound
read-only — and it starts a session in a few milliseconds (benchmarks/bench_sandbox.py), so every session of
every rollout can have one. Per session: new mount, PID, IPC, UTS, cgroup, user and network namespaces
(`--unshare-all`, the user one explicitly: as root the sandbox user is uid 1000 with no capabilities,
`--cap-drop ALL`), `--die-with-parent` and `--new-session` (no TIOCSTI into our terminal); the allow-list of
mounts.py read-only; a private `/proc`, `/dev`, `/tmp` and HOME (tmpfs with a size); the workspace read-write.
When the harness (bwrap's child) exits, the namespace's init goes and the kernel kills everything left in it:
a `setsid` daemon with a cleaned environment included. Where no cgroup holds the session's process count, the first
command inside is `prlimit --nproc` (limits.py says where it binds and where it does not).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from polar_mitm.sandbox.base import HOME_INSIDE, Sandbox, SandboxUnavailable, SessionBox
from polar_mitm.sandbox.limits import MIB
from polar_mitm.sandbox.mounts import Mount, system_mounts, toolchain_mounts

SANDBOX_UID = 1000  # who the session is inside (root outside when we are root: files it writes stay ours)
HOSTNAME = "polar-sandbox"
SETUP_HINT = "install it with scripts/setup-sandbox.sh (Debian: apt-get install bubblewrap socat)"


class Bwrap(Sandbox):
    kind = "bwrap"

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or shutil.which("bwrap") or "bwrap"

    def check(self) -> None:
        for tool in ("bwrap", "socat"):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(
                    f"--sandbox bwrap: {tool} is not installed: {SETUP_HINT}, or pass --sandbox none"
                )
        problem = _probe(self.binary)
        if problem:
            raise SandboxUnavailable(
                f"--sandbox bwrap cannot create a sandbox here ({problem}); pass --sandbox none"
            )

    def wrap(
        self, box: SessionBox, argv: list[str], env: dict[str, str], cwd: Path
    ) -> tuple[list[str], dict[str, str]]:
        # bwrap's child inherits bwrap's environment, so the host env of bwrap is the session's, nothing more.
        inner = self.inner_command(box, argv)
        # No cgroup counts its processes: RLIMIT_NPROC, set in its user namespace.
        if "pids" not in box.held_by_cgroup:
            inner = [*box.limits.process_limit_argv(), *inner]
        return [self.binary, *self.arguments(box, cwd), "--", *inner], self.inner_env(box, env)

    def arguments(self, box: SessionBox, cwd: Path) -> list[str]:
        """bwrap's options for `box`: namespaces, then the file system in mount order (later binds sit on top)."""
        # A gateway on a port below 1024: its forwarder must bind that port in the sandbox's own network, which
        # takes CAP_NET_BIND_SERVICE there, kept across exec only for uid 0 (of the sandbox's user namespace).
        low_port = any(port < 1024 for port in box.ports) and os.geteuid() == 0
        uid = "0" if low_port else str(SANDBOX_UID)
        args = ["--unshare-all", "--unshare-user", "--uid", uid, "--gid", uid, "--hostname", HOSTNAME]
        args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        if low_port:
            args += ["--cap-add", "CAP_NET_BIND_SERVICE"]
        binds, links = system_mounts()
        for mount in binds:
            args += _bind(mount)
        for link, target in links:
            args += ["--symlink", target, link]
        for secret in HOST_SECRETS:  # root-only on the host, the sandbox user's in its user namespace: hidden
            if os.path.exists(secret):
                args += ["--ro-bind", "/dev/null", secret]
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--size", str(box.limits.tmp_mb * MIB), "--tmpfs", "/tmp"]
        if box.home is None:
            args += ["--size", str(box.limits.home_mb * MIB), "--tmpfs", str(HOME_INSIDE)]
        for mount in [*toolchain_mounts(), *box.mounts()]:
            args += _bind(mount)
        args += ["--chdir", box.relocate(str(cwd))]
        return args


# Files under the read-only system binds that only root may read on the host. Inside, the session's user namespace
# maps host root to the sandbox user, so their owner's bits would let the session read them.
HOST_SECRETS = (
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/shadow-",
    "/etc/gshadow-",
    "/etc/ssh/ssh_host_rsa_key",
    "/etc/ssh/ssh_host_ecdsa_key",
    "/etc/ssh/ssh_host_ed25519_key",
    "/etc/sudoers",
)


def _bind(mount: Mount) -> list[str]:
    return ["--bind" if mount.writable else "--ro-bind", str(mount.host), str(mount.inside)]


@functools.cache
def _probe(binary: str) -> str:
    """'' when a minimal sandbox like a session's starts here, else why not (bwrap's own words)."""
    try:
        done = subprocess.run(
            [
                binary,
                "--unshare-all",
                "--unshare-user",
                "--ro-bind",
                "/",
                "/",
                "--proc",
                "/proc",
                "--",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return (
        "" if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    )
