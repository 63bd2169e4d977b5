"""The fork server behind `forkserver.spawn`: `python -m polar_mitm.processes.preload_server SOCKET [--preload SET]`.

It imports what our module children import (a preload set: `engine`, `gateway`), then forks one child per request,
single-threaded (it refuses to serve if an import started a thread: a fork would copy a lock some thread holds). A
child joins the namespaces asked for, takes the caller's descriptors at the caller's numbers, its environment and
working directory, and runs the module as `__main__` exactly as `python -m` would, exit status included. The server
reaps its children and sends each one's wait status and CPU seconds to the connection that started it; it ends when
the process that started it does (or on SIGTERM), leaving running children to run on.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

from polar_mitm.processes import children
from polar_mitm.processes.forkserver import HEADER, MAX_FDS, STATS_FILE, import_time_env, interpreter_identity

# What each kind of child imports before it does anything of its own (measured: `python -X importtime`).
PRELOAD_SETS: dict[str, tuple[str, ...]] = {
    "engine": (
        "torch",
        "transformers",
        "transformers.modeling_utils",
        "transformers.activations",
        "transformers.masking_utils",
        "transformers.models.qwen3.modeling_qwen3",
        "transformers.models.llama.modeling_llama",
        "transformers.tokenization_utils_tokenizers",
        "uvicorn",
        "uvicorn.loops.uvloop",
        "uvicorn.protocols.http.h11_impl",
        "uvicorn.lifespan.on",
        "polar_mitm.engine.server",
        "polar_mitm.engine.generation",
        "polar_mitm.engine.model_zoo",
        "polar_mitm.engine.tiny_model",
        "polar_mitm.engine.script",
        "polar_mitm.user_errors",
    ),
    "gateway": (
        "uvloop",
        "mitmproxy.tools.main",
        "mitmproxy.tools.dump",
        "polar_mitm.gateway.addons",
    ),
    # `polar-mitm COMMAND` (polar_mitm/__main__.py): every subcommand's module, as polar_mitm/cli.py registers them
    "cli": (
        "typer",
        "polar_mitm.agent.cli",
        "polar_mitm.engine.cli",
        "polar_mitm.user_errors",
        "polar_mitm.loop.cli",
        "polar_mitm.rollout.cli",
        "polar_mitm.reconstruct.cli",
        "polar_mitm.harness.cli",
        "polar_mitm.tasks.cli",
        "polar_mitm.train.cli",
        "polar_mitm.train.config_options",
        "polar_mitm.config_file",
        "polar_mitm.service.cli",
        "polar_mitm.dashboard.cli",
        "polar_mitm.vllm.cli",
        "polar_mitm.doctor",
        "polar_mitm.gateway.foreground",
    ),
    # what `loop` and `grpo` import to train (TRL's GRPO trainer and ours: ~6.5 s of CPU)
    "trainer": (
        "trl",
        "trl.trainer.grpo_trainer",
        "polar_mitm.train.grpo_trainer",
        "polar_mitm.train.run",
        "polar_mitm.loop.loop",
        "polar_mitm.reconstruct.prefix_merging",
    ),
}


def preload(names: list[str]) -> list[str]:
    """Import each set's modules; the ones that would not import (an optional extra not installed: its child pays
    for the import itself, nothing more)."""
    missing = []
    for name in names:
        for module in PRELOAD_SETS[name]:
            try:
                importlib.import_module(module)
            except ImportError:
                missing.append(module)
    return missing


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it (a child of the caller's own would have had them under the caller)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(
                int(stat.parent.name)
            )
    found, todo = [], [pid]
    while todo:
        found.append(current := todo.pop())
        todo += children.get(current, [])
    return found


# Native threads that survive a fork by design: jemalloc (pyarrow's allocator) takes its locks around fork() and
# starts its background thread again in the child when it needs one.
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def single_threaded() -> bool:
    """No thread but ours and the fork-safe ones, Python's or native (an OpenMP pool: torch starts one unless
    OMP_NUM_THREADS=1): a fork copies only the forking thread, and a lock another thread held stays held."""
    others = 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            others += Path(f"/proc/self/task/{task}/comm").read_text().strip() not in FORK_SAFE_THREADS
    return others == 1


class Server:
    def __init__(self, path: str, env_before_preload: dict[str, str]) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_w = wake_w
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        self.selector.register(self.wake_r, selectors.EVENT_READ, "reap")
        self.children: dict[
            int, tuple[socket.socket, bool]
        ] = {}  # pid -> (its caller's connection, term on close)
        self.running = True
        self.joinable: dict[tuple[str, ...], bool] = {}
        self.stats: dict[str, dict[str, int]] = {}
        self.stats_path = Path(path).with_name(STATS_FILE)
        self.identity = interpreter_identity()
        self.import_env = import_time_env(env_before_preload)
        # What the imports themselves set (torch: TORCHINDUCTOR_CACHE_DIR): a fresh child's imports would set it too.
        self.set_by_imports = {k: v for k, v in os.environ.items() if env_before_preload.get(k) != v}

    def _stop(self, *_: object) -> None:
        self.running = False

    def serve(self) -> None:
        while self.running:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "reap":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
                    self._reap()
                else:
                    self._caller_gone(key.fileobj, key.data)
            self._reap()  # a SIGCHLD may land between select's return and the handler's wake-up

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(5.0)  # a caller that connects and says nothing must not stall every other start
        try:
            request, fds = _read_request(conn)
        except (OSError, ValueError):
            conn.close()
            return
        conn.settimeout(None)
        try:
            declined = self._declined(request, fds)
            self._count(request.get("module", "?"), declined)
            if declined:
                conn.sendall(json.dumps({"declined": declined}).encode() + b"\n")
                conn.close()
                return
            pid = os.fork()
            if pid == 0:
                _run_child(request, fds, self.set_by_imports)  # never returns
            self.children[pid] = (conn, bool(request.get("term_on_disconnect")))
            self.selector.register(conn, selectors.EVENT_READ, pid)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _count(self, module: str, declined: str) -> None:
        """What it forked and what it declined, and why, in STATS_FILE beside its socket (`forkserver.Server.stats`)."""
        key = f"declined: {declined}" if declined else "forked"
        self.stats.setdefault(key, {}).setdefault(module, 0)
        self.stats[key][module] += 1
        with contextlib.suppress(OSError):
            partial = self.stats_path.with_suffix(".partial")
            partial.write_text(json.dumps(self.stats))
            partial.replace(self.stats_path)

    def _declined(self, request: dict, fds: list[int]) -> str:
        if any(request.get(k) != v for k, v in self.identity.items()):
            return "another interpreter or checkout"
        theirs = {  # a caller that imported torch itself carries what the import set: so does every child here
            k: v for k, v in (request.get("import_env") or {}).items() if self.set_by_imports.get(k) != v
        }
        if theirs != self.import_env:
            differing = sorted(
                k for k in {*theirs, *self.import_env} if theirs.get(k) != self.import_env.get(k)
            )
            return f"an import-time variable differs ({', '.join(differing)})"
        if len(fds) != len(request.get("targets", [])):
            return "descriptors missing"
        if not single_threaded():
            return "the server has threads"
        if not self._joinable(request.get("namespaces") or []):
            return "its namespaces cannot be joined from here"
        return ""

    def _joinable(self, paths: list[str]) -> bool:
        """Can a child join these namespaces? Tried once per set in a throwaway child (setns may need rights the
        caller's own `nsenter` has and we lack), so a start that could not join goes the usual way instead of
        failing."""
        try:
            key = tuple(os.readlink(path) for path in paths)
        except OSError:
            return False
        if key == tuple(os.readlink(f"/proc/self/ns/{Path(path).name}") for path in paths):
            return True
        if key not in self.joinable:
            pid = os.fork()
            if pid == 0:
                try:
                    _join_namespaces(paths)
                    os._exit(0)
                except BaseException:
                    os._exit(1)
            _, status = os.waitpid(pid, 0)
            self.joinable[key] = os.waitstatus_to_exitcode(status) == 0
        return self.joinable[key]

    def _caller_gone(self, conn: socket.socket, pid: int) -> None:
        """The caller ended: its child follows it. SIGTERM if it asked to be tied to its caller (what
        PR_SET_PDEATHSIG gives a child of the caller's own), else SIGKILL to it and all under it, as killing the
        caller's process group or its process tree would have: nothing is left running for nobody."""
        with contextlib.suppress(OSError):
            if conn.recv(1, socket.MSG_PEEK):
                return  # a caller does not write after its request; ignore stray bytes' wake-up
        self.selector.unregister(conn)
        _, tied = self.children.get(pid, (None, False))
        for victim in [pid] if tied else process_tree(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGTERM if tied else signal.SIGKILL)

    def _reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn, _ = self.children.pop(pid, (None, False))
            if conn is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            with contextlib.suppress(OSError):
                cpu = usage.ru_utime + usage.ru_stime
                conn.sendall(json.dumps({"status": status, "cpu": round(cpu, 3)}).encode() + b"\n")
            conn.close()


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, MAX_FDS)
    while len(data) < HEADER.size:
        more = conn.recv(1 << 16)
        if not more:
            raise ValueError("short request")
        data += more
    (size,) = HEADER.unpack_from(data)
    while len(data) < HEADER.size + size:
        more = conn.recv(1 << 16)
        if not more:
            raise ValueError("short request")
        data += more
    return json.loads(data[HEADER.size : HEADER.size + size]), list(fds)


def _join_namespaces(paths: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for path in paths:  # user first, then net: the order nsenter uses
        if os.readlink(path) == os.readlink(f"/proc/self/ns/{Path(path).name}"):
            continue  # already in it (joining one's own user namespace is an error)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, 0) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns {path}: {os.strerror(err)}")
        finally:
            os.close(fd)


def _place_fds(fds: list[int], targets: list[int]) -> None:
    """The caller's descriptors at the caller's numbers; every other descriptor closed (as Popen's close_fds)."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024 + i) for i, fd in enumerate(fds)]
    for fd, target in zip(high, targets, strict=True):
        os.dup2(fd, target)
    keep = set(targets)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _show_in_proc(argv: list[str], env: dict[str, str]) -> None:
    """Put the child's own `python -m MODULE ARGS` and environment where /proc/PID/cmdline and /proc/PID/environ
    (ps, pgrep -f, anything that reads them) find them: in place, in the argv and environment areas the server was
    started with, which it padded for this (what setproctitle does, NUL-separated). What does not fit its room is
    left as the server's."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        # arg_start, arg_end, env_start, env_end: proc(5) fields 48-51
        arg_start, arg_end, env_start, env_end = (int(f) for f in fields[45:49])
    except (OSError, IndexError, ValueError):
        return
    _write_area(arg_start, arg_end, b"\0".join(_bytes(arg) for arg in argv) + b"\0")
    _write_area(env_start, env_end, b"".join(_bytes(f"{k}={v}") + b"\0" for k, v in env.items()))


def _bytes(text: str) -> bytes:
    return text.encode(errors="surrogateescape")


def _write_area(start: int, end: int, text: bytes) -> None:
    if 0 < start and len(text) <= end - start:
        ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_child(request: dict, fds: list[int], set_by_imports: dict[str, str]) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _join_namespaces(request["namespaces"])
        os.umask(int(request.get("umask", 0o022)))
        _place_fds(fds, request["targets"])
        os.environ.clear()
        os.environ.update(request["env"])
        for key, value in set_by_imports.items():
            os.environ.setdefault(key, value)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # what `python -m` puts first
        with contextlib.suppress(ImportError):
            import numpy

            numpy.random.seed()  # the server's state is every child's otherwise (Python's random reseeds itself)
        if os.isatty(1):  # a fresh interpreter line-buffers a terminal; the server's stdout was not one
            sys.stdout.reconfigure(line_buffering=True)
        sys.argv = [request["module"], *request["args"]]
        sys.modules.pop(
            request["module"], None
        )  # run afresh as __main__, as `python -m` does (no second copy)
        _show_in_proc([request["executable"], "-m", request["module"], *request["args"]], request["env"])
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:
            traceback.print_exc()
            code = 1
        with contextlib.suppress(Exception):
            threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as interpreter exit does
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m polar_mitm.processes.preload_server")
    parser.add_argument("socket", help="Unix socket path to listen on (its folder should be private).")
    parser.add_argument(
        "--preload", action="append", choices=sorted(PRELOAD_SETS), default=[], help="What to import first."
    )
    parser.add_argument("--room", default="", help="Padding: argv space for children's command lines.")
    args = parser.parse_args()
    children.die_with_parent()
    env_before_preload = dict(os.environ)
    missing = preload(args.preload)
    if missing:
        print(
            f"preload_server: not importable here, left to each child: {', '.join(missing)}", file=sys.stderr
        )
    if not single_threaded():
        print(
            "preload_server: an import started a thread; serving nothing (forks would be unsafe)",
            file=sys.stderr,
        )
    # Out of the collector's sight: a child's collections would otherwise walk (and so copy, page by page) every
    # object the server imported, for nothing: none of them is garbage. (gc.freeze exists for fork servers.)
    gc.freeze()
    server = Server(args.socket, env_before_preload)
    print("ready", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
