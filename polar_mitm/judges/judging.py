"""A finished rollout's sessions judged: their rewards combined with the judge's scores before the rewards file.

Called by `polar-mitm rollout` and the loop once the sessions are done (never inside the runner, so a slow judge
holds no RUN worker and no workspace). For each task with a `judge`, its mode (MODES) makes the calls from the
sessions' traces (trace.py, read from the rollout's records); each call is answered from the cache when the same
content was judged before, else by the judge (client.py); its prompt, answer and parsed scores are kept
(storage/judgments.py). Then `reward = outcome + weight · normalised score`. A call that fails (the judge down, or
an answer that does not parse) leaves its sessions their outcome and is counted, or with `--judge-failure fail`
fails the rollout once every call has been tried (the files say which and why).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from polar_mitm.judges import MODES
from polar_mitm.judges.base import JudgeCall, JudgedSession
from polar_mitm.judges.client import JudgeClient, JudgeUnavailable
from polar_mitm.judges.options import JudgeFailure, JudgeOptions, judge_api_key
from polar_mitm.judges.prompt import JudgeAnswerError, json_answer
from polar_mitm.judges.trace import session_trace
from polar_mitm.storage import judgments as stored
from polar_mitm.storage.records import read_all
from polar_mitm.storage.session_records import read_live_session
from polar_mitm.tasks.task_file import Task

log = logging.getLogger(__name__)
TRACE_COLUMNS = ["session_id", "seq", "call_kind", "messages_json", "response_json"]


class FinishedSession(Protocol):
    """What judging needs of a finished session (rollout/runner.py's SessionRun)."""

    task: Task
    index: int
    session_id: str
    reward: float | None
    eval_output: str


class JudgeFailed(RuntimeError):
    """`--judge-failure fail` and a judge call failed: the rollout has no rewards."""


@dataclass(frozen=True)
class JudgePlaces:
    """Where judging reads and writes."""

    records: Path  # the rollout's records folder (gateway shards and journals)
    judgments: Path  # ROLLOUT/judgments (storage/judgments.py)
    cache: Path  # RUN/judge-cache
    harness_logs: Path | None = None  # the harness logs, SESSION_ID.log
    # Read each judged session's records alone (storage.session_records, following the folder), not the whole
    # folder: the rollout service's records folder grows for days while it judges a few sessions at a time.
    records_per_session: bool = False


@dataclass
class JudgeCounts:
    sessions: int = 0  # judged sessions, from the judge or the cache
    cached: int = 0  # of them, answered from the cache
    failed: int = 0  # sessions left their outcome (the judge down or unparseable)
    calls: int = 0  # HTTP attempts made

    def line(self, failure: JudgeFailure) -> str:
        failed = f", {self.failed} failed (→ {failure.value})" if self.failed else ""
        return f"judge: {self.sessions} session(s) judged ({self.cached} from the cache){failed}, {self.calls} call(s)"


def judge_problem(tasks: Sequence[Task], options: JudgeOptions) -> str | None:
    """Why these tasks cannot be judged with these options (one line), before any session runs; None if they can."""
    if not any(task.judge is not None for task in tasks):
        return None
    if options.judge_url is None:
        judged = next(task.task_id for task in tasks if task.judge is not None)
        return f"task {judged!r} has a judge: give --judge-url (an OpenAI-compatible …/v1 endpoint)"
    return options.problem()


def judge_sessions(
    sessions: Sequence[FinishedSession], options: JudgeOptions, places: JudgePlaces
) -> JudgeCounts:
    """Judge every session whose task has a judge and whose check gave a reward; their `reward` is replaced by the
    combined one. Raises JudgeFailed under `--judge-failure fail` when a call failed."""
    judged = [s for s in sessions if s.task.judge is not None and s.reward is not None]
    counts = JudgeCounts()
    if not judged:
        return counts
    if options.judge_url is None:
        raise JudgeFailed(judge_problem([s.task for s in judged], options))
    errors = asyncio.run(_judge_all(judged, options, places, counts))
    stored.write_summary(places.judgments, counts.__dict__ | {"failure": options.judge_failure.value})
    if errors and options.judge_failure is JudgeFailure.fail:
        raise JudgeFailed(
            f"{len(errors)} judge call(s) failed, the first: {errors[0]} (see {places.judgments})"
        )
    return counts


async def _judge_all(
    judged: list[FinishedSession], options: JudgeOptions, places: JudgePlaces, counts: JudgeCounts
) -> list[str]:
    traces = _traces(judged, places, options.judge_budget)
    groups: dict[str, list[FinishedSession]] = {}
    for session in judged:
        groups.setdefault(session.task.task_id, []).append(session)
    async with JudgeClient(
        options.judge_url or "",
        options.judge_model,
        api_key=judge_api_key(options.judge_api_key_env),
        timeout=options.judge_timeout,
        attempts=options.judge_retries,
        concurrency=options.judge_concurrency,
    ) as client:
        work = []
        for group in groups.values():
            task = group[0].task
            mode = MODES[task.judge.mode]  # type: ignore[union-attr]
            seen = [
                JudgedSession(s.session_id, s.index, float(s.reward), traces[s.session_id]) for s in group
            ]  # type: ignore[arg-type]
            work += [(task, call) for call in mode.calls(task.prompt, task.judge, seen)]  # type: ignore[arg-type]
        by_id = {s.session_id: s for s in judged}
        answers = _Answers(client, places.cache)
        results = await asyncio.gather(
            *(_answer(answers, task, call, options, places) for task, call in work)
        )
        counts.calls = client.calls
    errors = []
    for (task, call), (status, scores, error, key) in zip(work, results, strict=True):
        errors += [error] if error else []
        for session_id in call.sessions:
            _apply(by_id[session_id], task, status, scores.get(session_id), error, key, places, counts)
    return errors


def content_key(options: JudgeOptions, mode: str, call: JudgeCall) -> str:
    """The cache key of a call: a hash of what is judged and by whom (never of the prompt, whose fence is random)."""
    content = {"model": options.judge_model, "mode": mode, "judged": call.content}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:32]


# Calls in flight by (cache folder, content key), across threads: the service judges each finished session on its
# own thread (service/judging.py), so two alike sessions finishing together would both miss the cache and both ask.
_IN_FLIGHT: dict[tuple[Path, str], concurrent.futures.Future[str]] = {}
_IN_FLIGHT_LOCK = threading.Lock()


class _Answers:
    """Answer texts by content key: the cache's, else one judge call per key however many calls share it, in this
    judging or another running beside it (two sessions that did the same thing are judged once)."""

    def __init__(self, client: JudgeClient, cache: Path) -> None:
        self.client, self.cache = client, cache

    async def text(
        self, key: str, messages: list[dict[str, str]], parse: Callable[[str], Any]
    ) -> tuple[str, str]:
        """(judged | cached, the answer text); JudgeUnavailable when the judge gave none. The answer is cached
        (before the call leaves the in-flight table, so no caller misses both) only when `parse` accepts it."""
        place = (self.cache, key)
        with _IN_FLIGHT_LOCK:
            if (cached := stored.cached_answer(self.cache, key)) is not None:
                return "cached", str(cached["answer"])
            flight = _IN_FLIGHT.get(place)
            if owner := flight is None:
                flight = _IN_FLIGHT[place] = concurrent.futures.Future()
        if not owner:
            return "cached", await asyncio.wrap_future(flight)
        try:
            answer = await self.client.complete(messages)
            try:
                parse(answer)
                stored.cache_answer(self.cache, key, {"answer": answer})  # only an answer that parsed
            except JudgeAnswerError:
                pass  # the caller parses it again and says why
            flight.set_result(answer)
            return "judged", answer
        except BaseException as exc:
            flight.set_exception(exc)
            raise
        finally:
            with _IN_FLIGHT_LOCK:
                del _IN_FLIGHT[place]


async def _answer(
    answers: _Answers, task: Task, call: JudgeCall, options: JudgeOptions, places: JudgePlaces
) -> tuple[str, dict[str, tuple[float, float, str]], str, str]:
    """One call's (status, scores by session, error, cache key), from the cache or the judge; its file written."""
    mode = MODES[task.judge.mode]  # type: ignore[union-attr]
    key = content_key(options, mode.name, call)
    status, answer, error, scores = "failed", "", "", {}

    def parse(text: str) -> dict[str, tuple[float, float, str]]:
        return mode.scores(call, task.judge, json_answer(text))  # type: ignore[arg-type]

    try:
        status, answer = await answers.text(key, call.messages, parse)
        scores = parse(answer)
    except (JudgeUnavailable, JudgeAnswerError) as exc:
        status, error = "failed", str(exc)
        log.warning("judge call for %s failed: %s", ", ".join(call.sessions), error)
    stored.write_call(
        places.judgments,
        key,
        {"messages": call.messages, "answer": answer, "status": status, "error": error, "parsed": scores},
    )
    return status, scores, error, key


def _apply(
    session: FinishedSession,
    task: Task,
    status: str,
    scored: tuple[float, float, str] | None,
    error: str,
    key: str,
    places: JudgePlaces,
    counts: JudgeCounts,
) -> None:
    """The session's combined reward, and its judgment file."""
    judge, outcome = task.judge, float(session.reward)  # type: ignore[arg-type]
    score, raw, rationale = scored if scored is not None else (None, None, "")
    if score is None:
        counts.failed += 1
    else:
        counts.sessions += 1
        counts.cached += status == "cached"
        session.reward = outcome + judge.weight * score  # type: ignore[union-attr]
    stored.write_judgment(
        places.judgments,
        stored.Judgment(
            session_id=session.session_id,
            task_id=task.task_id,
            sample_index=session.index,
            mode=judge.mode,  # type: ignore[union-attr]
            status="failed" if score is None else status,
            outcome=outcome,
            score=score,
            raw_score=raw,
            reward=session.reward,
            rationale=rationale,
            error=error,
            call=stored.call_file(key),
        ),
    )


def _traces(sessions: list[FinishedSession], places: JudgePlaces, budget: int) -> dict[str, str]:
    """Each session's trace, from the rollout's records and its harness log."""
    by_session: dict[str, list[dict[str, Any]]] = {s.session_id: [] for s in sessions}
    if places.records.exists():
        tables = (
            [read_live_session(places.records, session_id) for session_id in by_session]
            if places.records_per_session
            else [read_all(places.records)]
        )
        for table in tables:
            table = table.select([c for c in TRACE_COLUMNS if c in table.column_names])
            for row in table.to_pylist():
                if row["session_id"] in by_session:
                    by_session[row["session_id"]].append(row)
    traces = {}
    for s in sessions:
        harness_log = ""
        if (path := harness_log_path(places.harness_logs, s.session_id)) is not None:
            harness_log = path.read_bytes()[-budget:].decode("utf-8", "replace")
        traces[s.session_id] = session_trace(
            by_session[s.session_id], harness_log, s.eval_output[-2000:], budget
        )
    return traces


def harness_log_path(logs: Path | None, session_id: str) -> Path | None:
    """A session's harness log: `logs/SESSION.log`, or one folder down (`logs/NODE/SESSION.log`: a Ray rollout's
    nodes each log under their own folder); None when there is none."""
    if logs is None:
        return None
    if (path := logs / f"{session_id}.log").is_file():
        return path
    return next((p for p in logs.glob(f"*/{session_id}.log") if p.is_file()), None)
