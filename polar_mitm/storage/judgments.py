"""What an LLM judge said about a rollout's sessions, kept for inspection, and the cache of its answers.

    ROLLOUT/judgments/SESSION_ID.json   one per judged session: mode, outcome, score, reward, how it was decided
                                        (judged | cached | failed), the error if it failed, and the call it came from
    ROLLOUT/judgments/calls/KEY.json    one per judge call: the prompt sent, the answer text, what was parsed of it
    ROLLOUT/judgments/summary.json      the counts: sessions judged, answered from the cache, failed; calls made
    RUN/judge-cache/KEY.json            answers that parsed, by KEY = a hash of the judged content (model, mode,
                                        task judge, instruction, outcome, traces): a second identical judgement
                                        makes no call

ROLLOUT is the folder of one rollout (`polar-mitm rollout`'s --work-dir, the loop's iter-K or eval-K); RUN is the
run's (the cache is shared by its rollouts). None of it is training data: judge calls go through no gateway of the
run, and nothing here is read by the merge. The judge's API key is never written here.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

JUDGMENTS_DIR = "judgments"
JUDGE_CALLS_DIR = "calls"  # in JUDGMENTS_DIR
JUDGE_SUMMARY_FILE = "summary.json"  # in JUDGMENTS_DIR
JUDGE_CACHE_DIR = "judge-cache"  # in the run's folder
JUDGMENT_STATUSES = ("judged", "cached", "failed")


@dataclass(frozen=True)
class Judgment:
    """One session's judgment: its outcome (the check's reward), the judge's normalised score and the reward."""

    session_id: str
    task_id: str
    sample_index: int
    mode: str
    status: str  # judged | cached | failed
    outcome: float | None
    score: float | None  # normalised: rubric score / max, group 0..1, reference 1 or 0; None if failed
    raw_score: float | None  # as the judge gave it (rubric: on the task's scale)
    reward: float | None  # outcome + weight · score, or the outcome when the judgment failed
    rationale: str = ""
    error: str = ""
    call: str = ""  # the call's file, relative to JUDGMENTS_DIR

    def __post_init__(self) -> None:
        if self.status not in JUDGMENT_STATUSES:
            raise ValueError(f"judgment status {self.status!r} is not one of {', '.join(JUDGMENT_STATUSES)}")


def _write_json(path: Path, value: Any) -> None:
    """Atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as file:
        json.dump(value, file, indent=1, ensure_ascii=False)
    os.replace(tmp, path)


def call_file(key: str) -> str:
    """A judge call's file, relative to JUDGMENTS_DIR."""
    return f"{JUDGE_CALLS_DIR}/{key}.json"


def write_judgment(judgments: Path, judgment: Judgment) -> None:
    _write_json(judgments / f"{judgment.session_id}.json", asdict(judgment))


def write_call(judgments: Path, key: str, call: dict[str, Any]) -> None:
    """A call's prompt (`messages`), `answer` text and `parsed` result, as sent and received."""
    _write_json(judgments / call_file(key), call)


def write_summary(judgments: Path, counts: dict[str, int]) -> None:
    _write_json(judgments / JUDGE_SUMMARY_FILE, counts)


def read_judgments(judgments: Path) -> dict[str, Judgment]:
    """The judgments of a rollout, by session id."""
    found = {}
    for path in sorted(judgments.glob("*.json")):
        if path.name != JUDGE_SUMMARY_FILE:
            judgment = Judgment(**json.loads(path.read_text()))
            found[judgment.session_id] = judgment
    return found


def cached_answer(cache: Path, key: str) -> dict[str, Any] | None:
    """The cached answer for judged content KEY (`answer` text and `parsed`), if any."""
    path = cache / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # a torn or foreign file: judged again, then replaced
        return None


def cache_answer(cache: Path, key: str, entry: dict[str, Any]) -> None:
    _write_json(cache / f"{key}.json", entry)
