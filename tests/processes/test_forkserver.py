"""Children forked from the preload server (processes/forkserver.py, preload_server.py) are started as `python -m`
would start them: each property is read from a real child started both ways and compared, not from a list of
expectations. The suite's engines and gateways start this way (tests/conftest.py), so every test of them also runs
through it; these tests pin what a caller could tell apart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_mitm.harness.netns import LoopbackNamespace, NamespaceUnavailable
from polar_mitm.processes import forkserver

PROBE = "tests.processes.child_probe"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    """A server with nothing preloaded (quick to start); the probe is imported by each child itself."""
    with forkserver.serving(preload=()) as srv:
        deadline = time.monotonic() + 60
        while not os.path.exists(srv.socket_path):
            assert srv.proc.poll() is None and time.monotonic() < deadline, (
                "the preload server did not come up"
            )
            time.sleep(0.05)
        yield srv


def start(args: list[str], *, forked: bool, env: dict[str, str] | None = None, **kwargs) -> object:
    env = env if env is not None else dict(os.environ)
    if forked:
        child = forkserver.popen_module(PROBE, args, env=env, **kwargs)
        assert isinstance(child, forkserver.ForkedChild)
        return child
    previous = os.environ.pop(forkserver.SOCKET_ENV)
    try:
        child = forkserver.popen_module(PROBE, args, env=env, **kwargs)
    finally:
        os.environ[forkserver.SOCKET_ENV] = previous
    assert isinstance(child, subprocess.Popen)
    return child


def test_a_forked_child_has_the_arguments_folder_variables_descriptors_and_command_line_of_a_fresh_one(
    server, tmp_path, monkeypatch, request
):
    monkeypatch.chdir(ROOT)
    reports = {}
    previous_umask = os.umask(0o027)  # not the server's: the child must take ours
    request.addfinalizer(lambda: os.umask(previous_umask))
    for forked in (False, True):
        read_fd, write_fd = os.pipe()
        os.write(write_fd, b"handed over")
        os.close(write_fd)
        log = tmp_path / f"log-{forked}"
        env = {**os.environ, "PROBE_VAR": "a value", "PROBE_FD": str(read_fd)}
        with open(log, "wb") as out:
            child = start(
                ["report", str(tmp_path / "report.json")],
                forked=forked,
                env=env,
                stdout=out,
                pass_fds=(read_fd,),
            )
        os.close(read_fd)
        assert child.wait(60) == 0
        reports[forked] = json.loads((tmp_path / "report.json").read_text())
        assert log.read_text().splitlines() == ["to stdout", "to stderr"]
        assert reports[forked]["piped"] == "handed over"
    fresh, forked = reports[False], reports[True]
    assert forked["umask"] == 0o027
    assert forked["argv"][1:] == fresh["argv"][1:] and Path(forked["argv"][0]).name == "child_probe.py"
    fresh["argv"][0] = forked["argv"][0] = ""  # the same file, through either path to it
    fresh["fds"] = [fd for fd in fresh["fds"] if fd != int(fresh["fds"][-1])]  # the listing's own descriptor
    forked["fds"] = [fd for fd in forked["fds"] if fd != int(forked["fds"][-1])]
    assert forked == fresh


@pytest.mark.parametrize("args", [["exit", "0"], ["exit", "3"], ["say", "no such task"], ["raise"]])
def test_a_forked_child_ends_with_the_status_and_last_words_of_a_fresh_one(
    server, tmp_path, monkeypatch, args
):
    monkeypatch.chdir(ROOT)
    seen = []
    for forked in (False, True):
        log = tmp_path / f"log-{forked}"
        with open(log, "wb") as out:
            child = start(args, forked=forked, stdout=out)
        code = child.wait(60)
        lines = log.read_text().splitlines()
        seen.append((code, lines[-1] if lines else ""))
    assert seen[1] == seen[0]


def test_atexit_hooks_run_and_threads_are_joined_before_a_forked_child_ends(server, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "order"
    child = start(["atexit", str(out)], forked=True)
    assert child.wait(60) == 0
    assert out.read_text() == "thread\natexit\n"  # interpreter exit: join the threads, then atexit


def test_terminate_wait_and_poll_behave_as_popens(server, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    pid_file = tmp_path / "pid"
    child = start(["sleep", str(pid_file)], forked=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert int(pid_file.read_text()) == child.pid and child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    cpu_before = server.children_cpu_seconds()
    child.terminate()
    assert child.wait(30) == -signal.SIGTERM and child.poll() == -signal.SIGTERM
    assert child.cpu_seconds is not None and child.cpu_seconds > 0
    assert server.children_cpu_seconds() >= cpu_before
    child.kill()  # after its end: nothing happens, as with Popen


@pytest.mark.parametrize("tied", [True, False])
def test_a_child_ends_with_the_process_that_started_it(server, tmp_path, tied):
    """Tied (`tie_to_parent`): SIGTERM, as PR_SET_PDEATHSIG gives a child of its own; untied: SIGKILL, as the
    starter's process group takes a child of its own with it. Either way none is left running for nobody."""
    pid_file = tmp_path / "pid"
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "from polar_mitm.processes import forkserver\n"
            f"c = forkserver.popen_module({PROBE!r}, ['sleep', {str(pid_file)!r}], env=dict(os.environ),"
            f" tie_to_parent={tied})\n"
            "print(type(c).__name__, flush=True)\n"
            "time.sleep(600)\n",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert starter.stdout.readline().strip() == "ForkedChild"
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, "the child outlived its starter"
        time.sleep(0.05)
    noted = pid_file.with_suffix(".signal")
    assert (noted.read_text() if noted.exists() else "SIGKILL") == ("SIGTERM" if tied else "SIGKILL")


def test_a_start_the_preloaded_modules_could_not_honour_goes_the_usual_way(server, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    env = {**os.environ, "HF_HOME": str(tmp_path / "another-hub-cache")}  # huggingface_hub reads it at import
    assert forkserver.spawn(PROBE, ["exit", "0"], env=env) is None
    child = forkserver.popen_module(PROBE, ["exit", "4"], env=env)
    assert isinstance(child, subprocess.Popen) and child.wait(60) == 4


@pytest.fixture
def namespace():
    try:
        with LoopbackNamespace() as ns:
            yield ns
    except NamespaceUnavailable as exc:
        pytest.skip(f"no private network namespace here: {exc}")


def test_a_forked_child_joins_the_network_namespace_asked_for(server, tmp_path, monkeypatch, namespace):
    monkeypatch.chdir(ROOT)
    report = tmp_path / "report.json"
    child = start(["report", str(report)], forked=True, netns=namespace)
    assert child.wait(60) == 0
    inside = os.readlink(f"/proc/{namespace.pid}/ns/net")
    assert json.loads(report.read_text())["net_ns"] == inside != os.readlink("/proc/self/ns/net")


def test_a_command_handed_over_from_inside_a_network_namespace_runs_inside_it(server, tmp_path, namespace):
    """The README's quick start runs `polar-mitm` in a private namespace with fixed ports: its command must not
    land on the host's network through the server."""
    report = tmp_path / "report.json"
    code = (
        "from polar_mitm.processes import forkserver\n"
        f"forkserver.run_preloaded({PROBE!r}, ['report', {str(report)!r}])\n"
        "raise SystemExit('not handed over')\n"
    )
    done = subprocess.run(namespace.wrap([sys.executable, "-c", code]), cwd=ROOT, timeout=60)
    assert done.returncode == 0
    assert json.loads(report.read_text())["net_ns"] == os.readlink(f"/proc/{namespace.pid}/ns/net")


BIN = Path(sys.executable).parent


def run_cli(argv: list[str], *, handed_over: bool, server) -> tuple[int, str, str]:
    env = dict(os.environ)
    if not handed_over:
        env.pop(forkserver.SOCKET_ENV)
    reaped_before = server.children_cpu_seconds()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    deadline = time.monotonic() + 10
    while handed_over and server.children_cpu_seconds() == reaped_before:  # the server's child ran it
        assert time.monotonic() < deadline, "the command was not handed to the preload server"
        time.sleep(0.05)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        [str(BIN / "polar-mitm"), "--version"],
        [str(BIN / "polar-mitm"), "merge", "/nonexistent/flows"],
        [sys.executable, "-m", "polar_mitm", "loop", "--group-size", "zero", "tasks.jsonl"],
    ],
)
def test_a_command_handed_to_the_server_says_and_exits_as_it_does_afresh(server, argv):
    assert run_cli(argv, handed_over=True, server=server) == run_cli(argv, handed_over=False, server=server)


def test_signals_reach_the_handed_over_command_and_its_end_is_the_callers(server, tmp_path):
    pid_file = tmp_path / "pid"
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from polar_mitm.processes import forkserver\n"
            f"forkserver.run_preloaded({PROBE!r}, ['sleep', {str(pid_file)!r}])\n"
            "raise SystemExit('not handed over')\n",
        ],
        cwd=ROOT,
    )
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert starter.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    assert int(pid_file.read_text()) != starter.pid  # the server's child runs it
    starter.send_signal(signal.SIGTERM)
    assert starter.wait(30) == -signal.SIGTERM
    assert pid_file.with_suffix(".signal").read_text() == "SIGTERM"


def test_a_start_in_namespaces_the_server_cannot_join_goes_the_usual_way(server, monkeypatch):
    monkeypatch.chdir(ROOT)
    gone = ["/proc/999999999/ns/net"]  # no such process: nothing to join, so nothing is forked
    assert forkserver.spawn(PROBE, ["exit", "0"], env=dict(os.environ), namespaces=gone) is None
