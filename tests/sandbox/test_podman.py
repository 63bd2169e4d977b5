"""`--sandbox podman` for real (issue 41): rootful podman (runc) on a debootstrap root file system
(`scripts/setup-podman.sh`; no image registry is reachable here). A `cmd:` session in the container calls the model
through the gateway's tunnel (answered and recorded), cannot read a planted host file or write outside its workspace,
and its check runs in the same container and passes. Skipped, saying why, where podman or the root file system is
missing (scripts/test.sh does not make it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from polar_mitm.storage.records import read_all
from tests.tasks.test_swe_tasks import rollout_cli

ROOT = Path(__file__).resolve().parents[2]
ROOTFS = Path(os.environ.get("POLAR_PODMAN_ROOTFS", ROOT / ".podman-rootfs"))

AGENT = """import json, os, urllib.request
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
request = urllib.request.Request(os.environ["POLAR_BASE_URL"] + "/v1/chat/completions", body,
                                 {"content-type": "application/json"})
open("answer.json", "wb").write(urllib.request.urlopen(request, timeout=60).read())
report = []
for path in (SECRET, "/root/.ssh"):
    try:
        report.append(f"read {path}: {open(path).read()!r}")
    except OSError as exc:
        report.append(f"blocked {path}: {type(exc).__name__}")
for path in ("/usr/pwned", os.path.dirname(os.getcwd()) + "/pwned-beside"):
    try:
        open(path, "w").write("x")
        report.append(f"wrote {path}")
    except OSError as exc:
        report.append(f"blocked {path}: {type(exc).__name__}")
open("report.txt", "w").write("\\n".join(report) + "\\n")
"""


@pytest.mark.skipif(
    shutil.which("podman") is None, reason="podman is not installed (scripts/setup-podman.sh)"
)
@pytest.mark.skipif(
    not (ROOTFS / "usr" / "bin" / "socat").exists(), reason=f"no root file system at {ROOTFS}"
)
def test_a_session_in_rootful_podman_reaches_only_the_gateway(tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host-secret-7")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "agent.py").write_text(AGENT.replace("SECRET", repr(str(secret))))
    check = "grep -q choices answer.json && ! grep -q '^read\\|^wrote' report.txt"
    line = {"task_id": "in-podman", "prompt": "hi", "workspace": {"dir": str(workspace)}, "eval": check}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(line) + "\n")
    agent = f"cmd:{ROOT / '.venv' / 'bin' / 'python'} agent.py"
    [row] = rollout_cli(
        tasks, agent, tmp_path, "-g", "1", "--sandbox", "podman", "--image", str(ROOTFS), "--keep-workspaces"
    )
    [kept] = (tmp_path / "run" / "workspaces").glob("in-podman-*")
    report = (kept / "report.txt").read_text()
    assert (row["status"], row["reward"]) == ("ok", 1.0), (row, report)
    assert "host-secret-7" not in report and report.count("blocked") == 4, report
    [record] = read_all(tmp_path / "flows").to_pylist()
    assert record["status_code"] == 200 and record["completion_ids"]
