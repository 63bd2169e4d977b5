"""The rollout service's folder (`polar-mitm serve-rollouts --out OUT`): every name in one place.

    OUT/flows/                      the gateways' records (a record folder, as `rollout --out` writes)
    OUT/tasks/<task>/request.json   a submitted TaskRequest, written (fsynced) before the submit is answered
    OUT/tasks/<task>/results.jsonl  one SessionResult per finished session, appended and fsynced before anyone
                                    hears of it (status, events, callback): what `--resume` reports again
    OUT/tasks/<task>/delivered.jsonl  {"session_id"} of each result its callback_url acknowledged (fsynced): what
                                    `--resume` need not send again
    OUT/tasks/<task>/held.jsonl     one finished session per line that waits for its group's judge (mode group),
                                    appended and fsynced as it is held: `--resume` judges it with its group instead
                                    of running it again (`HeldSession`)
    OUT/tasks/<task>/state.json     {"status": running | completed | failed | cancelled, "submitted_at": unix s}
    OUT/tasks/<task>/judgments/     what the judge said of its sessions (evaluator strategy rubric): one file per
                                    session, the calls, summary.json (the layout of storage/judgments.py)
    OUT/judge-cache/                the judge's answers by judged content (storage/judgments.py), for every task
    OUT/work/                       workspaces, harness logs, the gateway's and engine's logs, mitmproxy's confdir

`<task>` is the task id made safe for a file name, with a hash of the id so two ids never share a folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from polar_mitm.storage.journal import fsync_dir
from polar_mitm.storage.json_lines import append_line, read_lines
from polar_mitm.storage.judgments import JUDGE_CACHE_DIR, JUDGMENTS_DIR

__all__ = [
    "JUDGE_CACHE_DIR",
    "append_line",
    "judgments_dir",
    "read_lines",
    "task_dir",
    "write_durable",
    "write_task",
]

FLOWS_DIR = "flows"
TASKS_DIR = "tasks"
WORK_DIR = "work"
REQUEST_FILE = "request.json"
RESULTS_FILE = "results.jsonl"
STATE_FILE = "state.json"
DELIVERED_FILE = "delivered.jsonl"
HELD_FILE = "held.jsonl"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def task_dir(out: Path, task_id: str) -> Path:
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:12]
    return out / TASKS_DIR / f"{_UNSAFE.sub('_', task_id)[:80]}-{digest}"


def judgments_dir(folder: Path) -> Path:
    """A task's judgments (`folder`: its task_dir)."""
    return folder / JUDGMENTS_DIR


def write_durable(path: Path, text: str) -> None:
    """`path` holds the old text or the new, whenever the process dies (temp file, fsync, rename, fsync dir)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_task(folder: Path, request_json: str, submitted_at: float) -> None:
    """A submitted task's folder: its request and a running state, each durable (a task of the same id submitted
    again after it finished starts a new run: its old results, state and deliveries go first)."""
    for name in (RESULTS_FILE, STATE_FILE, DELIVERED_FILE, HELD_FILE):
        (folder / name).unlink(missing_ok=True)
    write_durable(folder / REQUEST_FILE, request_json)
    write_durable(folder / STATE_FILE, json.dumps({"status": "running", "submitted_at": submitted_at}))
