"""`polar-mitm doctor` (issue 38): the real command, its lines checked against what is really on this machine.

Two harnesses are pointed at empty install folders (their presets' own variables), so a missing harness is seen
whatever this machine has installed; every other harness line must say what its preset finds here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm.engines import keys as engine_keys
from polar_mitm.harness import HARNESSES, HarnessError
from polar_mitm.processes import ports

BIN = Path(sys.executable).parent
CHECK_NAMES = [
    "python",
    "node",
    "npm",
    *(f"harness {name}" for name in HARNESSES),
    "mitmdump",
    "mitmproxy CA",
    "engine",
    "vllm",
    "bwrap",
    "user namespace",
    "gpu",
]
STATUSES = ("ok", "warning", "missing", "info")
# Moved to empty folders: (harness, its preset's variable, the setup command the line must name).
ABSENT = [
    ("cline", "POLAR_CLINE_PREFIX", "bash scripts/setup-cline.sh"),
    ("aider", "POLAR_AIDER_VENV", "bash scripts/setup-aider.sh"),
]


@pytest.fixture
def absent_env(tmp_path, monkeypatch) -> dict[str, str]:
    """The variables that move two harnesses' installs to empty folders, also applied to this process."""
    env = {}
    for name, variable, _ in ABSENT:
        (tmp_path / name).mkdir()
        env[variable] = str(tmp_path / name)
        monkeypatch.setenv(variable, env[variable])
    return env


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "polar-mitm"), "doctor", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def lines_by_check(stdout: str) -> dict[str, str]:
    """Each check's line, by check name (the line is `STATUS  NAME  DETAIL…`)."""
    found = {}
    for line in stdout.splitlines():
        for name in CHECK_NAMES:
            status, _, rest = line.partition(" ")
            if status in STATUSES and rest.lstrip().startswith(f"{name} ") and name not in found:
                found[name] = line
    return found


def installed_here(harness) -> bool:
    try:
        harness.executable()
    except HarnessError:
        return False
    return True


def test_each_check_has_a_line_and_the_harness_lines_match_this_machine(tmp_path, absent_env):
    done = doctor("--confdir", str(tmp_path / "no-mitmproxy"), env=absent_env)
    lines = lines_by_check(done.stdout)
    assert list(lines) == CHECK_NAMES, done.stdout + done.stderr
    for name, harness in HARNESSES.items():
        line = lines[f"harness {name}"]
        if installed_here(harness):
            assert line.startswith("ok ") and str(harness.executable()) in line, line
        else:
            assert line.startswith("missing ") and "fix: bash scripts/setup" in line, line
    for name, _, setup in ABSENT:
        if shutil.which(HARNESSES[name].binary) is None:  # (a preset falls back to PATH)
            line = lines[f"harness {name}"]
            assert line.startswith("missing ") and line.endswith(f"fix: {setup}"), line
    assert lines["mitmproxy CA"].startswith("warning ") and "polar-mitm gateway" in lines["mitmproxy CA"]
    assert lines["engine"].startswith("info ")  # not asked for
    assert lines["bwrap"].startswith("ok " if shutil.which("bwrap") else "missing ")
    assert lines["gpu"].startswith("info ")
    # Python and mitmdump are what this suite itself runs on: nothing required is missing.
    assert lines["python"].startswith("ok ") and lines["mitmdump"].startswith("ok ")
    assert done.returncode == 0 and done.stdout.rstrip().splitlines()[-1].startswith("ready"), done.stdout


def test_json_reports_a_dead_engine_as_missing_and_exits_1(tmp_path):
    dead = f"http://127.0.0.1:{ports.free_port()}"
    done = doctor("--engine", dead, "--json", "--confdir", str(tmp_path))
    report = json.loads(done.stdout)
    assert [check["name"] for check in report["checks"]] == CHECK_NAMES
    engine = next(check for check in report["checks"] if check["name"] == "engine")
    assert engine["status"] == "missing" and engine["required"] is True, engine
    assert f"--engine {dead}: nothing answers" in engine["detail"] and engine["fix"]
    assert report["ok"] is False and done.returncode == 1, done.stderr


def test_a_live_engine_and_a_made_ca_are_ok(tmp_path, engine_url):
    from mitmproxy.certs import CertStore

    CertStore.from_store(tmp_path, "mitmproxy", 2048)  # what mitmproxy writes at its first start
    key = engine_keys.key_for(engine_url) or ""
    done = doctor("--engine", engine_url, "--confdir", str(tmp_path), env={engine_keys.KEY_ENV: key})
    lines = lines_by_check(done.stdout)
    assert lines["engine"].startswith("ok ") and f"{engine_url} answers: " in lines["engine"], lines["engine"]
    assert "weight version" in lines["engine"]  # its /model_info, read with the key
    assert lines["mitmproxy CA"].startswith("ok ") and "valid until" in lines["mitmproxy CA"]
    assert done.returncode == 0, done.stdout
