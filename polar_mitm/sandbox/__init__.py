"""Sandboxes: every rollout session (its agent, then its evaluation) in one, picked once by this registry.

    none     the host, unconfined (must be asked for; a warning says so)           none.py
    bwrap    bubblewrap namespaces, the default (a few ms per session)             bwrap.py
    podman   a container from --image, same contract (run: test_podman.py)        container.py
    docker   likewise (its command line tested: no docker engine runs here)

Why: a session runs an agent we do not trust on a machine that holds what grades it, the engine it could sample
from unrecorded and the other sessions' workspaces. Each kind shows a session only its workspace, a private /tmp
and HOME, the system and the harness installs read-only (mounts.py), and no network but its gateway's ports
through a Unix-socket tunnel (tunnel.py); its memory and processes are bounded by the session cgroup (rlimits where
none can be made) and its open files and file sizes by rlimits (limits.py). See recipes/sandboxes.md.
"""

from __future__ import annotations

from polar_mitm.sandbox.base import Sandbox, SandboxUnavailable, SessionBox
from polar_mitm.sandbox.bwrap import Bwrap
from polar_mitm.sandbox.container import Container
from polar_mitm.sandbox.limits import Limits, LimitsSpec
from polar_mitm.sandbox.none import WARNING as UNCONFINED_WARNING
from polar_mitm.sandbox.none import NoSandbox

SANDBOX_KINDS = ("none", "bwrap", "podman", "docker")
DEFAULT_SANDBOX = "bwrap"

__all__ = [
    "DEFAULT_SANDBOX",
    "SANDBOX_KINDS",
    "UNCONFINED_WARNING",
    "Limits",
    "LimitsSpec",
    "Sandbox",
    "SandboxUnavailable",
    "SessionBox",
    "get_sandbox",
]


def get_sandbox(kind: str, image: str | None = None) -> Sandbox:
    """The sandbox of `kind`, checked to run here (SandboxUnavailable says why not and what to do)."""
    if kind == "none":
        return NoSandbox()
    if kind == "bwrap":
        sandbox: Sandbox = Bwrap()
    elif kind in ("podman", "docker"):
        sandbox = Container(kind, image)
    else:
        raise SandboxUnavailable(f"--sandbox {kind!r}: choose one of {', '.join(SANDBOX_KINDS)}")
    sandbox.check()
    return sandbox
