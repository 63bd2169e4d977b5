"""The gateway's secrets stay in the gateway (issue 36 item 1).

Its control token, the engine's API key and the session key reach it through an inherited pipe
(polar_mitm/processes/secret_handover.py). Read as any process of the same user reads them: no
`/proc/PID/environ` or `/proc/PID/cmdline` on the host holds one, the pipe is closed once read, and the token
still works. Before, a `cmd:` agent read `POLAR_CONTROL_TOKEN` from the gateway's exec-time environment and
moved every record to its folder.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx

from polar_mitm.engines import keys as engine_keys
from polar_mitm.gateway import control
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.processes import secret_handover


def _readable_process_files() -> list[bytes]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            for name in ("environ", "cmdline"):
                try:
                    found.append((entry / name).read_bytes())
                except OSError:
                    continue
    return found


def test_no_process_file_holds_a_gateway_secret_and_the_token_still_switches(scripted_engine_url, tmp_path):
    session_key = secrets.token_urlsafe(32)
    gw = gateway_processes.start_gateway(
        scripted_engine_url, tmp_path / "a", confdir=tmp_path / "conf", session_key=session_key
    )
    try:
        engine_key = engine_keys.key_for(scripted_engine_url)
        wanted = {"control token": gw.control_token, "engine key": engine_key, "session key": session_key}
        assert all(wanted.values())
        files = _readable_process_files()
        assert len(files) > 4  # this process, the engine and the gateway among them
        leaked = {name for name, value in wanted.items() if any(value.encode() in data for data in files)}
        assert leaked == set()
        # The pipe's number is in the gateway's environment; the pipe itself is closed once read.
        environ = Path(f"/proc/{gw.proc.pid}/environ").read_bytes().split(b"\0")
        number = next(v.split(b"=", 1)[1] for v in environ if v.startswith(secret_handover.FD_ENV.encode()))
        target = Path(f"/proc/{gw.proc.pid}/fd/{number.decode()}")
        assert not target.exists() or not os.readlink(target).startswith("pipe:")
        # A process of the same user that guesses has nothing to send; the holder's token still works.
        guess = httpx.post(
            f"{gw.reverse_url}{control.CONTROL_PATH}",
            json={"options": {"polar_out": str(tmp_path / "stolen")}},
            headers={control.TOKEN_HEADER: "guess"},
            timeout=30,
        )
        assert guess.status_code == 403
        gw.switch(tmp_path / "b")
        assert not (tmp_path / "stolen").exists()
    finally:
        gw.stop()


def test_a_secret_taken_once_is_not_handed_on_to_what_the_child_starts(tmp_path):
    """The child reads the pipe whole at its first `take` and closes it: its own children inherit nothing."""
    child = (
        "import os, subprocess, sys\n"
        "from polar_mitm.processes import secret_handover\n"
        "print(secret_handover.take('control_token'))\n"
        "grandchild = 'from polar_mitm.processes import secret_handover; print(secret_handover.take(\"control_token\"))'\n"
        "sys.stdout.flush()\n"
        "subprocess.run([sys.executable, '-c', grandchild], close_fds=False)\n"
    )
    handover = secret_handover.Handover({"control_token": "s3cret-token"})
    try:
        done = subprocess.run(
            [sys.executable, "-c", child],
            capture_output=True,
            text=True,
            timeout=60,
            **handover.popen_kwargs(dict(os.environ)),
        )
    finally:
        handover.close()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["s3cret-token", "None"]
