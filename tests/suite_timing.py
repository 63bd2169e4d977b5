"""How the suite's two workers share the work, and what it cost: the scheduler and the slowest-files table.

CI gives the suite 90 minutes on 2 cores, so the wall time is the busier worker's. pytest-xdist's `loadfile`
hands out files in collection order, which can leave the heaviest group (one vLLM server shared by all vLLM files)
to start last while the other worker idles. `LongestFirstScheduling` hands out the groups longest first, from the
seconds a previous full run recorded (`tests/scope_seconds.json`; longest-processing-time first keeps the two
workers within one short file of each other). A group the file does not know counts as its tests × a typical test.

Refresh the file after a change that moves a group's cost by minutes:
`POLAR_WRITE_SCOPE_SECONDS=1 bash scripts/test.sh` (a full run rewrites it at the end).

The table also gives each file's CPU seconds (`PhaseCpu`): with both cores busy, the suite's wall time is its CPU
over two, so CPU is what a change to the suite's length has to cut, and wall seconds alone hide it (a file waiting on
a harness's network timeouts is long and cheap; one that imports torch in ten processes is short and dear).
"""

from __future__ import annotations

import json
import os
import resource
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

SCOPE_SECONDS = Path(__file__).with_name("scope_seconds.json")
SECONDS_PER_UNKNOWN_TEST = 2.0
SLOWEST_FILES_SHOWN = 15

# A test file runs whole on one worker (its module fixtures start once), except where files share a costly session
# fixture: those go together so that it starts once in the run. vLLM files share one tiny vLLM server (4 GB, about a
# minute to start); the capstone starts a second vLLM, which must not pin the same core at the same time.
SHARED_GROUPS = {
    "vllm": ("tests/vllm/", "tests/engine/test_real_harness_learning.py"),
    "demo-run": ("tests/loop/test_demo_learning.py", "tests/report/"),
}


def xdist_group_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    for group, prefixes in SHARED_GROUPS.items():
        if path.startswith(prefixes):
            return group
    return path


def recorded_scope_seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(SCOPE_SECONDS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # no record yet (or a broken one): the order falls back to test counts


def longest_first_scheduling(config, log):
    from xdist.scheduler import LoadScopeScheduling

    recorded = recorded_scope_seconds()

    class LongestFirstScheduling(LoadScopeScheduling):
        """Whole groups to a worker (xdist's own `xdist_group` marks do not group under pytest 9.2), longest first."""

        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first assignment: the queue holds every group now
                self.ordered = True

                def expected(item: tuple[str, dict]) -> float:
                    scope, tests = item
                    return recorded.get(scope, len(tests) * SECONDS_PER_UNKNOWN_TEST)

                for scope, _tests in sorted(self.workqueue.items(), key=expected, reverse=True):
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return LongestFirstScheduling(config, log)


# CPU of processes started for this one but not its children: those the preload server forked (conftest.py).
CPU_ELSEWHERE: list[Callable[[], float]] = []


def cpu_seconds() -> float:
    """CPU of this process and of every child it has waited for (theirs includes the children they waited for),
    and of the children the preload server has reaped for it."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    elsewhere = sum(source() for source in CPU_ELSEWHERE)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + elsewhere


class PhaseCpu:
    """On each process that runs tests: the CPU seconds of each phase (setup, call, teardown) on its report, as
    `cpu_s` (pytest-xdist carries a report's attributes to the controller). A server a fixture shares is counted
    where it is stopped and waited for (the teardown of its scope's last test); a process nobody waits for (a daemon
    that detaches) is not counted."""

    def __init__(self) -> None:
        self.phase_cpu: dict[tuple[str, str], float] = {}

    def measure(self, item, when: str):
        start = cpu_seconds()
        try:
            return (yield)
        finally:  # a failing phase too
            self.phase_cpu[(item.nodeid, when)] = cpu_seconds() - start

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        return (yield from self.measure(item, "setup"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        return (yield from self.measure(item, "call"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        return (yield from self.measure(item, "teardown"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        report.cpu_s = round(self.phase_cpu.pop((item.nodeid, call.when), 0.0), 3)
        return report


class SuiteTiming:
    """The controller's tally: seconds per file and per worker (setup + call + teardown), shown at the end."""

    def __init__(self) -> None:
        self.file_seconds: Counter[str] = Counter()
        self.file_cpu: Counter[str] = Counter()
        self.worker_seconds: Counter[str] = Counter()
        self.file_tests: defaultdict[str, set[str]] = defaultdict(set)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report) -> None:
        path = report.nodeid.split("::", 1)[0]
        self.file_seconds[path] += report.duration
        self.file_cpu[path] += getattr(report, "cpu_s", 0.0)
        self.file_tests[path].add(report.nodeid)
        worker = getattr(getattr(report, "node", None), "gateway", None)
        self.worker_seconds[worker.id if worker is not None else "main"] += report.duration

    def scope_seconds(self) -> dict[str, float]:
        scopes: Counter[str] = Counter()
        for path, seconds in self.file_seconds.items():
            scopes[xdist_group_of(path)] += seconds
        return {scope: round(seconds, 1) for scope, seconds in sorted(scopes.items())}

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.file_seconds:
            return
        write = terminalreporter.write_line
        write(
            f"\nslowest {SLOWEST_FILES_SHOWN} test files (setup + call + teardown; CPU: the tests' own and their processes'):"
        )
        for path, seconds in self.file_seconds.most_common(SLOWEST_FILES_SHOWN):
            write(
                f"{seconds:8.1f} s  {self.file_cpu[path]:7.1f} s CPU  {len(self.file_tests[path]):4} tests  {path}"
            )
        write(f"\ncostliest {SLOWEST_FILES_SHOWN} test files by CPU:")
        for path, cpu in self.file_cpu.most_common(SLOWEST_FILES_SHOWN):
            write(
                f"{cpu:8.1f} s CPU  {self.file_seconds[path]:7.1f} s  {len(self.file_tests[path]):4} tests  {path}"
            )
        busy = ", ".join(f"{w} {s:.0f} s" for w, s in sorted(self.worker_seconds.items()))
        cpu = sum(self.file_cpu.values())
        write(f"busy per worker: {busy}; in all {sum(self.file_seconds.values()):.0f} s, {cpu:.0f} s of CPU")
        if os.environ.get("POLAR_WRITE_SCOPE_SECONDS") == "1":
            merged = {
                **recorded_scope_seconds(),
                **self.scope_seconds(),
            }  # a partial run keeps the other groups
            SCOPE_SECONDS.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
            write(f"wrote {SCOPE_SECONDS}")
