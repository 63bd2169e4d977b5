"""What the runner tells a session's sandbox (polar_mitm/sandbox): the box of one session and its process setup.

Kept beside the runner, not in it: which host paths a session and its grader may see is a policy of its own (the
workspace at a Harbor task's workdir, a preset's prepared HOME, the gateway's CA bundle and ports, a SWE task's
grading spec and venv for its evaluation only), and so is the order of what happens between fork and exec.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from polar_mitm.rollout import session_cgroup
from polar_mitm.rollout.harness_spec import GatewayEndpoints
from polar_mitm.sandbox import UNCONFINED_WARNING, Sandbox, SessionBox
from polar_mitm.sandbox.limits import MIB
from polar_mitm.sandbox.tunnel import gateway_ports
from polar_mitm.tasks.task_file import Task


def session_box(
    sandbox: Sandbox,
    task: Task,
    workspace: Path,
    env: dict[str, str],
    gateway: GatewayEndpoints | None = None,
) -> SessionBox:
    """The session's sandbox: its workspace (at a Harbor task's workdir when it has one), the HOME its harness
    was given (a preset's prepared folder), the gateway's CA bundle and ports; no gateway: no network."""
    harbor = task.harbor
    readable = [gateway.ca_bundle] if gateway is not None and gateway.ca_bundle else []
    return SessionBox(
        workspace=workspace,
        workspace_inside=Path(harbor.workdir) if harbor is not None and sandbox.confines else None,
        home=Path(env["HOME"]) if "HOME" in env else None,
        readable=[Path(p).resolve() for p in readable],
        ports=gateway_ports(gateway.reverse_url, gateway.proxy_url) if gateway is not None else [],
        limits=task.limits,
    )


def session_group(sandbox: Sandbox, box: SessionBox, session_id: str) -> session_cgroup.SessionCgroup | None:
    """The session's cgroup (None where none can be made), its memory and process count limited when the session
    is sandboxed. Blocking (a cgroup's mkdir and limit writes take milliseconds in the kernel): the runner calls it
    in a thread."""
    group = session_cgroup.for_sessions().new(session_cgroup.group_name(session_id))
    if group is not None and sandbox.confines:
        box.held_by_cgroup = group.limit(box.limits.memory_mb * MIB, box.limits.pids)
    return group


def launch_prefix(sandbox: Sandbox, box: SessionBox, group: session_cgroup.SessionCgroup | None) -> list[str]:
    """What a session's process is started through: a shell that joins its cgroup (`session_group`), then
    `prlimit` lowering its rlimits (memory too where the cgroup does not hold it), then the sandbox. Exec wrappers
    rather than a `preexec_fn`: Python code between fork and exec makes every spawn a full fork of the runner's
    process with its event loop stopped (a spawn with a no-op preexec 11.4 ms, without 4.7 ms, measured here)."""
    prefix: list[str] = []
    if group is not None:
        prefix += group.join_argv()
    if sandbox.confines:
        prefix += box.limits.prlimit_argv(memory="memory" not in box.held_by_cgroup)
    return prefix


def grading_paths(task: Task) -> list[Path]:
    """What a task's own grader reads beside the workspace, shown read-only to its evaluation: a SWE task's grading
    spec and its venv (tasks/swe.py; the agent never sees them, its sandbox had neither)."""
    spec = (task.meta.get("swe") or {}).get("spec")
    if not spec:
        return []
    try:
        env_dir = json.loads(Path(spec).read_text()).get("env_dir")
    except (OSError, ValueError, AttributeError):
        env_dir = None
    return [Path(spec), *([Path(env_dir)] if env_dir else [])]


_warned: list[bool] = []


def warn_unconfined() -> None:
    """`--sandbox none`, said once per process on stderr."""
    if not _warned:
        _warned.append(True)
        print(UNCONFINED_WARNING, file=sys.stderr)
