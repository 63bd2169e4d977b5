"""`python -m tests.processes.child_probe MODE [ARGS]`: a child that reports what it was started with.

`report FILE`: writes its argv, working directory, one variable, its descriptors and the handover pipe's content to
FILE as JSON, then exits 0. `exit N`, `say TEXT`, `raise`: exits N, exits with SystemExit(TEXT), raises. `sleep FILE`:
writes its pid to FILE and sleeps; a SIGTERM is noted beside it (FILE.signal). `atexit FILE`: registers an atexit hook and a non-daemon thread, both writing to FILE.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path


def main() -> None:
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "report":
        fd = os.environ.get("PROBE_FD")
        piped = os.read(int(fd), 100).decode() if fd else None
        print("to stdout", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        Path(rest[0]).write_text(
            json.dumps(
                {
                    "argv": sys.argv,
                    "cwd": os.getcwd(),
                    "path0": sys.path[0],
                    "probe_var": os.environ.get("PROBE_VAR"),
                    "piped": piped,
                    "net_ns": os.readlink("/proc/self/ns/net"),
                    "umask": os.umask(0o022),
                    "cmdline": Path("/proc/self/cmdline").read_bytes().decode().rstrip("\0").split("\0"),
                    "environ": sorted(
                        Path("/proc/self/environ").read_bytes().decode().rstrip("\0").split("\0")
                    ),
                    "fds": sorted(int(n) for n in os.listdir("/proc/self/fd")),
                }
            )
        )
    elif mode == "exit":
        sys.exit(int(rest[0]))
    elif mode == "say":
        sys.exit(rest[0])
    elif mode == "raise":
        raise RuntimeError("the probe failed on purpose")
    elif mode == "sleep":
        pid_file = Path(rest[0])

        def note_and_die(signum: int, _frame: object) -> None:
            pid_file.with_suffix(".signal").write_text(signal.Signals(signum).name)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, note_and_die)
        pid_file.write_text(str(os.getpid()))
        time.sleep(600)
    elif mode == "atexit":
        out = Path(rest[0])
        atexit.register(lambda: out.write_text(out.read_text() + "atexit\n"))
        out.write_text("")

        def late() -> None:
            time.sleep(0.3)
            out.write_text(out.read_text() + "thread\n")

        threading.Thread(target=late).start()


if __name__ == "__main__":
    main()
