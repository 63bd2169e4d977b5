"""A Session page's data: each model call of one session in order, and the merged sequences it became.

A call shows the request as the harness sent it (`request_json`, provider-native), as the engine got it
(`messages_json`, the internal conversation), the answer (`response_json`), and its tokens: the prompt's (context,
mask 0) then the sampled ones (mask 1, with their logprobs). Tokens are decoded and long prompts elided exactly as
the static report's token viewer does (`report/trajectories.to_trajectory`), so both show the same thing. Only
this session's rows are read (`storage/session_records.read_live_session`: what the folder gained since the
last read).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from functools import lru_cache
from typing import Any

import pyarrow.compute as pc

from polar_mitm.dashboard.run_files import Stage
from polar_mitm.dashboard.sessions import judgments
from polar_mitm.report.trajectories import COLUMNS as MERGED_COLUMNS
from polar_mitm.report.trajectories import Trajectory, to_trajectory
from polar_mitm.storage.engine_info import ENGINE_FILE, read_engine_file
from polar_mitm.storage.judgments import JUDGMENTS_DIR
from polar_mitm.storage.location import StorageError
from polar_mitm.storage.merged import MergedShards
from polar_mitm.storage.session_records import read_live_session

log = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 1200  # the report's: a longer prompt shows its head and tail
# `end`: how the session ended, on merged sequences of runs that record it (absent before: read as None).
MERGED_EXTRA = ("request_ids", "weight_version_min", "weight_version_max", "builder", "finish_reason", "end")


def stage_tokenizer(stage: Stage):
    """The tokenizer the stage's engine used (its `_engine.json`), loaded once per process; None: ids only."""
    for engine_file in sorted(stage.flows_dir.rglob(ENGINE_FILE)) if stage.flows_dir.is_dir() else []:
        try:
            path = (read_engine_file(str(engine_file.parent)) or {}).get("tokenizer_path")
        except (OSError, ValueError):
            continue
        if path:
            tokenizer = _load_tokenizer(str(path))
            if tokenizer is not None:
                return tokenizer
    return None


@lru_cache(maxsize=4)
def _load_tokenizer(path: str):
    from polar_mitm.reconstruct.merge import shared_tokenizer

    try:
        return shared_tokenizer(path)
    except (OSError, ValueError):  # a path from another machine, or not a tokenizer
        return None


def pretty(text: str | None) -> str | None:
    """A JSON column indented for reading; left as it is when it does not parse."""
    if text is None:
        return None
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def tokens_json(trajectory: Trajectory) -> dict[str, Any]:
    """A decoded sequence for the page: tokens as [text, id, mask, logprob, turn] (compact for long ones)."""
    body = asdict(trajectory)
    body["tokens"] = [[t.text, t.token_id, t.mask, round(t.logprob, 4), t.turn] for t in trajectory.tokens]
    return body


def call_view(row: dict[str, Any], tokenizer) -> dict[str, Any]:
    """One record as the page shows it."""
    prompt = list(row.get("prompt_ids") or [])
    completion = list(row.get("completion_ids") or [])
    logprobs = list(row.get("completion_logprobs") or [])
    logprobs += [0.0] * (len(completion) - len(logprobs))
    sequence = {
        "sequence_id": row["request_id"],
        "session_id": row["session_id"],
        "task_id": row.get("task_id"),
        "input_ids": prompt + completion,
        "loss_mask": [0] * len(prompt) + [1] * len(completion),
        "logprobs": [0.0] * len(prompt) + logprobs[: len(completion)],
        "prompt_len": len(prompt),
        "n_turns": 1,
        "reward": None,
        "turn_starts": [len(prompt)] if completion else [],
    }
    started, finished = row["started_at"], row["finished_at"]
    return {
        "request_id": row["request_id"],
        "seq": row["seq"],
        "started_at": started.timestamp(),
        "finished_at": finished.timestamp(),
        "seconds": (finished - started).total_seconds(),
        "provider": row.get("provider"),
        "path": row.get("path"),
        "model_requested": row.get("model_requested"),
        "model_used": row.get("model_used"),
        "finish_reason": row.get("finish_reason"),
        "weight_version": row.get("weight_version"),
        "version_spans": row.get("version_spans"),  # [{start, version}]: several where a push landed mid-call
        "status_code": row.get("status_code"),
        "error": row.get("error"),
        "call_kind": row.get("call_kind"),
        "prompt_mode": row.get("prompt_mode"),
        "splice_reason": row.get("splice_reason"),
        "temperature": row.get("temperature"),
        "prompt_tokens": len(prompt),
        "completion_tokens": len(completion),
        "request_as_sent": pretty(row.get("request_json")),
        "request_as_engine_got": pretty(row.get("messages_json")),
        "tools": pretty(row.get("tools_json")),
        "answer": pretty(row.get("response_json")),
        "engine_meta": pretty(row.get("engine_meta_json")),
        "tokens": tokens_json(to_trajectory(sequence, tokenizer, MAX_PROMPT_TOKENS)),
    }


def merged_views(stage: Stage, session_id: str, tokenizer) -> list[dict[str, Any]]:
    """The session's merged sequences (what trained), decoded; none when the stage was not merged."""
    if not stage.merged_dir.is_dir():
        return []
    try:
        shards = MergedShards.at(stage.merged_dir)
        names = shards.dataset().schema.names
        columns = [c for c in (*MERGED_COLUMNS, *MERGED_EXTRA) if c in names]
        rows = shards.table(columns=columns, filter_expr=pc.field("session_id") == session_id).to_pylist()
    except (StorageError, OSError, ValueError) as exc:
        log.warning("%s: %s", stage.merged_dir, exc)
        return []
    views = []
    for row in rows:
        view = tokens_json(to_trajectory(row, tokenizer, MAX_PROMPT_TOKENS))
        view.update({name: row.get(name) for name in MERGED_EXTRA})
        views.append(view)
    return views


def judgment_view(stage: Stage, session_id: str) -> dict[str, Any] | None:
    """What a judge said of the session (its mode, score, rationale, the reward it made), and the judge call's
    answer as the judge wrote it; None when no judge scored it."""
    judgment = judgments(stage).get(session_id)
    if judgment is None:
        return None
    view = asdict(judgment)
    folder = (stage.root / JUDGMENTS_DIR).resolve()
    call = (folder / judgment.call).resolve() if judgment.call else None
    view["answer"] = None
    if call is not None and call.is_relative_to(folder) and call.is_file():
        try:
            view["answer"] = json.loads(call.read_text()).get("answer")
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("%s: %s", call, exc)
    return view


def session_view(stage: Stage, session: dict[str, Any]) -> dict[str, Any]:
    """The Session page: the session's row, its judgment, its calls in `seq` order, its merged sequences."""
    tokenizer = stage_tokenizer(stage)
    rows: list[dict[str, Any]] = []
    if stage.flows_dir.is_dir():
        rows = read_live_session(stage.flows_dir, session["session_id"]).to_pylist()
    rows.sort(key=lambda r: (r["seq"], r["started_at"]))
    return {
        "session": session,
        "calls": [call_view(row, tokenizer) for row in rows],
        "merged": merged_views(stage, session["session_id"], tokenizer),
        "judgment": judgment_view(stage, session["session_id"]),
        "decoded": tokenizer is not None,
    }
