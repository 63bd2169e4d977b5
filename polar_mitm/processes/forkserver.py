"""A preloaded Python that starts our module children by fork: `python -m MODULE ARGS` without paying its imports.

An engine start spends ~4 s of CPU importing torch and transformers' model code before it loads a byte of its model,
and a gateway ~1 s importing mitmproxy and the addon. A program that starts many of them (the test suite starts
~150 engines and ~200 gateways; a benchmark sweep; a rollout service restarting engines) keeps one server that has
imported them once and forks a child per start. The child is the same program as `python -m MODULE ARGS`: its own
process, arguments, environment, working directory, standard streams and inherited descriptors, run as `__main__`.

`spawn` answers None when no server is configured ($POLAR_FORKSERVER, a Unix socket) or the start would differ from
a fresh interpreter's (another interpreter or checkout, or a variable that libraries read at import differs): the
caller then starts the command as it always did. The server (`preload_server.py`) is single-threaded when it forks.
Its children are its own: it reaps them and reports each one's exit status (and CPU) to the connection that asked.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Protocol

SOCKET_ENV = "POLAR_FORKSERVER"

# Variables libraries read once, at import: a preloaded child cannot honour a value that differs from the server's.
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "MKL_",
    "KMP_",
    "CUDA",
    "DISABLE_",
    "WANDB",
    "MLFLOW",
    "TRL_",
    "ACCELERATE",
    "LD_",
    "MITMPROXY",
)

HEADER = struct.Struct("!I")
ROOM_FOR_COMMAND_LINES = 16384
ROOM_FOR_ENVIRONMENTS = 65536  # one string: under the kernel's 128 KiB per argument or variable
ROOM_ENV = "POLAR_FORKSERVER_ROOM"
MAX_FDS = 16


# ... but not these. The MLflow switch only saves an import, which the server has already paid (`polar-mitm loop`
# sets it, train/tracker_imports.py, before it starts its engines and gateways); W&B's service address and Python's
# breakpoint hook (Ray sets it) are read when used, not at import.
NOT_IMPORT_TIME = frozenset({"DISABLE_MLFLOW_INTEGRATION", "WANDB_SERVICE", "PYTHONBREAKPOINT"})

STATS_FILE = "stats.json"


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` that preloaded modules have already read: it must match the server's own."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in NOT_IMPORT_TIME}


def interpreter_identity() -> dict[str, str]:
    """What must be the same on both sides: the interpreter and the polar_mitm checkout it imports."""
    import polar_mitm

    return {"executable": sys.executable, "polar_mitm": str(Path(polar_mitm.__file__).resolve().parent)}


_RUNNING: dict[int, ForkedChild] = {}


class ForkedChild:
    """A child the server forked for us, with the part of `subprocess.Popen` our callers use.

    The server is its parent; it sends the wait status over our connection when the child ends, and ends the child
    when this process ends (closing the connection). Signals go through a pidfd where Linux has one, so a recycled
    pid is never signalled."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str]) -> None:
        self._conn = conn
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.cpu_seconds: float | None = None
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self._pidfd = os.pidfd_open(pid)
        _RUNNING[pid] = self  # our end of the connection is the child's life line: kept until it has ended

    def _read_status(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        data = b""
        with contextlib.suppress(OSError):
            while not data.endswith(b"\n"):
                chunk = self._conn.recv(4096)
                if not chunk:
                    break
                data += chunk
        try:
            status = json.loads(data)
            self.returncode = os.waitstatus_to_exitcode(int(status["status"]))
            self.cpu_seconds = float(status.get("cpu", 0.0))
        except (ValueError, KeyError, TypeError):
            self.returncode = self._lost_server(timeout)
            if self.returncode is None:
                return False
        self._close()
        return True

    def _lost_server(self, timeout: float | None) -> int | None:
        """The server went away before the child: wait for the child itself (its exit code is not ours to read)."""
        if self._pidfd is None:
            return -signal.SIGKILL
        ready, _, _ = select.select([self._pidfd], [], [], timeout)
        return -signal.SIGKILL if ready else None

    def _close(self) -> None:
        _RUNNING.pop(self.pid, None)
        with contextlib.suppress(OSError):
            self._conn.close()
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def own_namespaces() -> list[str]:
    """This process's user and network namespaces, as files a child can join (one it is in already is skipped)."""
    return [f"/proc/{os.getpid()}/ns/user", f"/proc/{os.getpid()}/ns/net"]


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def spawn(
    module: str,
    args: list[str],
    *,
    env: dict[str, str],
    stdout: int | None = None,
    stderr: int | None = None,
    pass_fds: tuple[int, ...] = (),
    cwd: str | None = None,
    namespaces: list[str] | None = None,
    term_on_disconnect: bool = False,
) -> ForkedChild | None:
    """`python -m module *args` forked from the preloaded server, or None (then start it the usual way).

    `stdout`/`stderr`: descriptors (default: ours); `pass_fds` keep their numbers in the child; `namespaces`:
    /proc/PID/ns/* files the child joins first (`nsenter`'s job; default: ours, so a caller inside a private network
    namespace gets a child inside it too). When this process ends the child gets SIGKILL, as
    a child of ours dies with our process group; `term_on_disconnect`: SIGTERM instead (what
    `children.die_with_parent` gives a child of our own)."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    fds = [0, stdout if stdout is not None else 1, stderr if stderr is not None else 2, *pass_fds]
    request = {
        **interpreter_identity(),
        "module": module,
        "args": args,
        "env": env,
        "cwd": cwd or os.getcwd(),
        "targets": [0, 1, 2, *pass_fds],
        "namespaces": namespaces or own_namespaces(),
        "umask": current_umask(),
        "term_on_disconnect": term_on_disconnect,
        "import_env": import_time_env(env),
    }
    payload = json.dumps(request).encode()
    try:
        socket.send_fds(conn, [HEADER.pack(len(payload)) + payload], fds)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
        reply = json.loads(answer) if answer else {}
    except (OSError, ValueError):
        conn.close()
        return None
    if "pid" not in reply:  # declined: another interpreter, checkout or import-time environment
        conn.close()
        return None
    return ForkedChild(conn, int(reply["pid"]), [sys.executable, "-m", module, *args])


class Namespaced(Protocol):
    """A network namespace to start a child in (harness/netns.LoopbackNamespace)."""

    def wrap(self, argv: list[str]) -> list[str]: ...

    def namespace_files(self) -> list[str]: ...


def popen_module(
    module: str,
    args: list[str],
    *,
    env: dict[str, str],
    stdout: IO[bytes] | int | None = None,
    pass_fds: tuple[int, ...] = (),
    netns: Namespaced | None = None,
    tie_to_parent: bool = False,
) -> subprocess.Popen | ForkedChild:
    """`python -m module *args` with stderr to stdout: forked from the preloaded server when there is one that
    can, else as a new interpreter (inside `netns` through nsenter; `tie_to_parent` by PR_SET_PDEATHSIG)."""
    if stdout is None or stdout == subprocess.DEVNULL:
        with open(os.devnull, "wb") as devnull:
            child = _spawn_logged(module, args, env, devnull.fileno(), pass_fds, netns, tie_to_parent)
    else:
        fd = stdout if isinstance(stdout, int) else stdout.fileno()
        child = _spawn_logged(module, args, env, fd, pass_fds, netns, tie_to_parent)
    if child is not None:
        return child
    from polar_mitm.processes import children

    cmd = [sys.executable, "-m", module, *args]
    return subprocess.Popen(
        netns.wrap(cmd) if netns is not None else cmd,
        stdout=stdout if stdout is not None else subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env=env,
        pass_fds=pass_fds,
        preexec_fn=children.die_with_parent if tie_to_parent else None,
    )


def _spawn_logged(
    module: str,
    args: list[str],
    env: dict[str, str],
    fd: int,
    pass_fds: tuple[int, ...],
    netns: Namespaced | None,
    tie_to_parent: bool,
) -> ForkedChild | None:
    return spawn(
        module,
        args,
        env=env,
        stdout=fd,
        stderr=fd,
        pass_fds=pass_fds,
        namespaces=netns.namespace_files() if netns is not None else None,
        term_on_disconnect=tie_to_parent,
    )


class Server:
    """A running preload server (`serving`): its socket and process."""

    def __init__(self, proc: subprocess.Popen, socket_path: str) -> None:
        self.proc, self.socket_path = proc, socket_path

    def children_cpu_seconds(self) -> float:
        """CPU of the children it has reaped so far (theirs is not in our own RUSAGE_CHILDREN: we are not their
        parent); 0 once it is gone."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime

    def stats(self) -> dict[str, dict[str, int]]:
        """{"forked" or "declined: WHY": {module: starts}} so far."""
        try:
            return json.loads(Path(self.socket_path).with_name(STATS_FILE).read_text())
        except (OSError, ValueError):
            return {}


@contextlib.contextmanager
def serving(
    preload: tuple[str, ...] = ("engine", "gateway", "cli", "trainer"), log: Path | None = None
) -> Iterator[Server]:
    """A preload server for this block, announced to us and every child we start through $POLAR_FORKSERVER.

    It is usable once its imports are done (a few seconds); starts before then go the usual way. Its socket lies in
    a folder only we can enter, and it ends with this block (or with us)."""
    folder = tempfile.mkdtemp(prefix="polar-forkserver-")  # mode 700
    path = os.path.join(folder, "socket")
    out = open(log, "ab") if log else subprocess.DEVNULL
    cmd = [sys.executable, "-m", "polar_mitm.processes.preload_server", path]
    cmd += [f"--preload={name}" for name in preload]
    # Room where each child writes its own command line and environment (what ps and /proc/PID/environ show).
    cmd += ["--room", " " * ROOM_FOR_COMMAND_LINES]
    env = {**os.environ, ROOM_ENV: " " * ROOM_FOR_ENVIRONMENTS}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if log:
        out.close()
    previous = os.environ.get(SOCKET_ENV)
    os.environ[SOCKET_ENV] = path
    try:
        yield Server(proc, path)
    finally:
        if previous is None:
            os.environ.pop(SOCKET_ENV, None)
        else:
            os.environ[SOCKET_ENV] = previous
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


RELAYED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def run_preloaded(module: str, args: list[str]) -> None:
    """Be `python -m module *args` by having the preload server fork it: relay our signals to it and end as it
    ends (its exit code, or the signal that killed it). Returns only when no server can take it, and the caller
    then runs the module itself. If we are SIGKILLed, the server kills it and all under it (`spawn`)."""
    inherited = tuple(fd for fd in _open_fds() if fd > 2 and _inheritable(fd))
    child = spawn(module, args, env=dict(os.environ), pass_fds=inherited)
    if child is None:
        return
    for sig in RELAYED_SIGNALS:
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # killed by a signal: so are we, for whoever waits on us
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:  # the listing's own descriptor, closed since
        return False


def _open_fds() -> list[int]:
    try:
        return sorted(int(name) for name in os.listdir("/proc/self/fd"))
    except OSError:
        return [0, 1, 2]
