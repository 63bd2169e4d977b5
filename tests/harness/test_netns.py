"""The loopback namespace a harness stack runs in (harness/netns.py): a port handed to a process in it is free in it.

The host cannot see the namespace's listeners, so a port the engine holds in there is free on the host and the
host's allocator may hand it out again: a gateway once failed to start in a long-session test with "address already
in use" on its engine's port. Here the host's allocator is made to repeat itself, as it did then."""

from __future__ import annotations

import subprocess
import sys

import pytest

from polar_mitm.harness.netns import LoopbackNamespace, NamespaceUnavailable
from polar_mitm.processes import ports


@pytest.fixture
def namespace():
    try:
        with LoopbackNamespace() as ns:
            yield ns
    except NamespaceUnavailable as exc:
        pytest.skip(f"no private network namespace here: {exc}")


def test_a_port_listening_in_the_namespace_is_not_handed_out_again(namespace, monkeypatch):
    taken = ports.free_port()
    server = subprocess.Popen(
        namespace.wrap([sys.executable, "-m", "http.server", str(taken), "--bind", "127.0.0.1"]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        namespace.wait_port(taken, proc=server)
        assert namespace.listening(taken)
        other = ports.free_port()
        answers = iter([taken, taken, other])  # the host's allocator repeats the port held in the namespace
        monkeypatch.setattr(ports, "free_port", lambda: next(answers))
        assert namespace.free_port() == other
    finally:
        server.kill()
        server.wait()


def test_a_port_handed_out_is_not_handed_out_again_before_its_process_listens(namespace, monkeypatch):
    first, second = ports.free_port(), ports.free_port()
    answers = iter([first, first, second])  # an engine still loading its model does not listen yet
    monkeypatch.setattr(ports, "free_port", lambda: next(answers))
    assert [namespace.free_port(), namespace.free_port()] == [first, second]
