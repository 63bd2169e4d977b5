"""Shared fixtures: real server processes (the embedded engine, later the gateway) on loopback ports."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.engines import processes as engine_processes
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.loop.trackers import offline_environment_values
from polar_mitm.processes import forkserver
from polar_mitm.session_ids import SessionId
from tests.suite_timing import CPU_ELSEWHERE, PhaseCpu, SuiteTiming, longest_first_scheduling
from tests.summary_tables import print_worker_tables, show_table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two workers on two cores, each often running an engine and a trainer at once: torch's OpenMP threads spinning
# while they wait take the core another process needs (the loop tests ran 13-24% longer with the default policy).
# Every process a test starts inherits this; the product's own defaults are left alone.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# And one thread each (engines and trainers alike): with both cores already taken by the two workers, a second
# thread per process only adds switching (the loop, GRPO and engine tests used 4-5% less CPU and ran 4-7% faster).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# MLflow and W&B stay off the network here, as the loop keeps them for its trackers (loop/trackers.py sets these in
# its own process): set from the start, every process the suite starts (and its preload server, whose imports of
# them read some at import) agrees on them, instead of the first in-process tracked loop changing them halfway.
for _name, _value in offline_environment_values().items():
    os.environ.setdefault(_name, _value)

# -- pytest-xdist (scripts/test.sh runs the suite on 2 workers): groups longest first (tests/suite_timing.py) ---------


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return longest_first_scheduling(config, log)


def pytest_configure(config):
    config.pluginmanager.register(PhaseCpu(), "polar-phase-cpu")  # on every process that runs tests
    runs_tests = hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
    if runs_tests and os.environ.get("POLAR_TEST_FORKSERVER", "1") != "0":
        # Engines and gateways fork from one preloaded interpreter per worker (processes/forkserver.py): an engine
        # start took ~4.8 s of CPU, ~3.7 of them imports; a gateway ~1.2 s, ~0.9 of them imports. Every process a
        # test starts finds it through $POLAR_FORKSERVER; POLAR_TEST_FORKSERVER=0 starts each one afresh.
        config.polar_forkserver = contextlib.ExitStack()
        server = config.polar_forkserver.enter_context(forkserver.serving())
        config.polar_forkserver_server = server
        CPU_ELSEWHERE.append(server.children_cpu_seconds)
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.polar_tables = Path(tempfile.mkdtemp(prefix="polar-test-tables-"))
        config.pluginmanager.register(SuiteTiming(), "polar-suite-timing")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["polar_tables"] = str(node.config.polar_tables)


def pytest_sessionfinish(session):
    stack = getattr(session.config, "polar_forkserver", None)
    if stack is not None:  # what the worker's preload server forked and declined (docs/testing.md)
        stats = session.config.polar_forkserver_server.stats()
        lines = [
            f"{what:<60} {module:<32} {n:>5}" for what, per in stats.items() for module, n in per.items()
        ]
        show_table(session.config, f"preload server ({os.getpid()}): starts by module", lines or ["none"])


def pytest_unconfigure(config):
    stack = getattr(config, "polar_forkserver", None)
    if stack is not None:
        stack.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    folder = getattr(config, "polar_tables", None)
    if folder is not None:
        print_worker_tables(folder, terminalreporter)
        shutil.rmtree(folder, ignore_errors=True)


TOOL_SCRIPT = [
    {
        "text": "Let me write the file.",
        "tool_call": {"name": "shell", "arguments": {"command": "echo hello > out.txt"}},
    },
    "Done: out.txt now says hello.",
]


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    """An in-process Engine with the same weights as the served tiny model (for scoring and tokenising)."""
    import torch

    from polar_mitm.engine.generation import Engine

    torch.set_num_threads(1)
    return Engine(tiny_model_dir)


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir, tmp_path_factory):
    """`polar-mitm serve --model tiny` in a child process."""
    with engine_processes.engine_running(
        model="tiny", log=tmp_path_factory.mktemp("engine") / "engine.log"
    ) as url:
        yield url


@pytest.fixture(scope="session")
def script_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("script") / "tool_script.json"
    path.write_text(json.dumps(TOOL_SCRIPT))
    return path


@pytest.fixture(scope="session")
def scripted_engine_url(tiny_model_dir, script_file, tmp_path_factory):
    """The tiny engine playing TOOL_SCRIPT: turn 1 a shell tool call, turn 2 a final answer."""
    with engine_processes.engine_running(
        model="tiny",
        log=tmp_path_factory.mktemp("engine-scripted") / "engine.log",
        extra_args=["--script", str(script_file)],
    ) as url:
        yield url


@pytest.fixture(scope="session")
def gateway(scripted_engine_url, tmp_path_factory):
    """mitmdump + addon/polar.py (regular and reverse listeners) in front of the scripted tiny engine."""
    root = tmp_path_factory.mktemp("gateway")
    with gateway_processes.gateway_running(
        scripted_engine_url, root / "flows", confdir=root / "conf", log=root / "gateway.log"
    ) as gw:
        gw.log = root / "gateway.log"
        yield gw


@pytest.fixture
def proxy_env(gateway, monkeypatch):
    """Point HTTPS_PROXY-honouring clients at the gateway with a session (and task) in the proxy user name."""

    def apply(session: str, task: str | None = None) -> None:
        monkeypatch.setenv(
            "HTTPS_PROXY", SessionId(session, task).proxy_url(f"127.0.0.1:{gateway.proxy_port}")
        )
        monkeypatch.setenv("SSL_CERT_FILE", str(gateway.ca_bundle()))
        for name in (
            "NO_PROXY",
            "no_proxy",
            "ALL_PROXY",
            "all_proxy",
            "HTTP_PROXY",
            "http_proxy",
            "https_proxy",
        ):
            monkeypatch.delenv(name, raising=False)

    return apply


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The demo's RL loop (README's main job), shortened to one training iteration + the trained policy's rollout.

    Shared by the learning test and the report tests: (run directory, the loop's per-iteration stats).
    """
    from polar_mitm.demo import demo_loop_config
    from polar_mitm.loop.loop import Loop

    run_dir = tmp_path_factory.mktemp("demo-run")
    return run_dir, Loop(demo_loop_config(model="tiny", iterations=1, run_dir=run_dir)).run()
