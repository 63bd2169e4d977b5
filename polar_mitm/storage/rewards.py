"""A rollout's rewards file: one row per harness session (its reward, status, end and timings), written by
`polar-mitm rollout` / `loop` and read by `polar-mitm merge --rewards` (to join rewards into sequences) and the report.

The contract: `REWARDS_SCHEMA` (Arrow) and `RewardRow` (the typed row); written as Parquet, or JSONL when the path
ends in `.jsonl`. The reader for merge takes any file with `session_id`, `reward` and, optionally, `task_id`,
`status` and `end` columns (JSONL or Parquet, local or a pyarrow filesystem URI), since rewards may come from
elsewhere than a rollout; other columns are ignored.

`status` is the runner's (ok | failed | timeout | crashed | init_failed | error | cut | cancelled); `end` is how the
session ended in the one vocabulary of `session_ends.py` (its runner status and its calls' records together), null
where the rollout could not read its records (a gateway attached elsewhere) and its status decides nothing, or in a
file written before ends were recorded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from polar_mitm.storage.location import StorageError, one_line, resolve_path
from polar_mitm.storage.session_ends import END_VALUES

REWARDS_SCHEMA = pa.schema(
    [
        ("session_id", pa.string()),
        ("task_id", pa.string()),
        ("sample_index", pa.int32()),
        ("reward", pa.float64()),
        ("status", pa.string()),
        ("end", pa.string()),  # session_ends.SessionEnd
        ("exit_code", pa.int32()),
        ("init_seconds", pa.float64()),
        ("run_seconds", pa.float64()),
        ("eval_seconds", pa.float64()),
        ("eval_output", pa.string()),
    ]
)


@dataclass
class RewardRow:
    """One harness session of a rollout, as its rewards file holds it (fields in REWARDS_SCHEMA's order)."""

    session_id: str
    task_id: str | None
    sample_index: int
    reward: float | None
    status: str
    end: str | None
    exit_code: int | None
    init_seconds: float | None
    run_seconds: float | None
    eval_seconds: float | None
    eval_output: str


def rewards_table(rows: Iterable[RewardRow]) -> pa.Table:
    """Reward rows → a REWARDS_SCHEMA table."""
    return pa.Table.from_pylist([asdict(row) for row in rows], schema=REWARDS_SCHEMA)


def write_rewards_table(table: pa.Table, path: Path) -> None:
    """A rewards table as Parquet, or JSONL when the path ends in .jsonl."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in table.to_pylist()))
    else:
        pq.write_table(table, path)


def read_rewards_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    """A rollout's rewards Parquet file as a table (`columns` only, when given; a column an older file lacks, such as
    `end`, reads null)."""
    if columns is None:
        return pq.read_table(path)
    present = set(pq.read_schema(path).names)
    table = pq.read_table(path, columns=[c for c in columns if c in present])
    for name in columns:
        if name not in present:
            kind = REWARDS_SCHEMA.field(name).type if name in REWARDS_SCHEMA.names else pa.null()
            table = table.append_column(name, pa.nulls(table.num_rows, kind))
    return table.select(columns)


# -- rewards by session, for merge -------------------------------------------------------------------------------


class RewardsError(StorageError):
    """A rewards file that cannot be used: missing, unreadable, or a row without a session or a finite reward."""


@dataclass(frozen=True)
class Reward:
    """A session's row as merge joins it: its reward (None: unrewarded, e.g. cut) and what else the file says."""

    reward: float | None
    task_id: str | None = None
    status: str | None = None  # the runner's, where the file says it
    end: str | None = None  # session_ends.SessionEnd, where the file says it


def read_rewards(uri: str) -> dict[str, Reward]:
    """Rewards by session id from JSONL (one object per line) or Parquet: `session_id`, `reward`, opt. `task_id`,
    `status` and `end`.

    Other columns (e.g. `polar-mitm rollout`'s timings) are ignored. A null reward leaves the session unrewarded:
    such a row is kept (reward None) only where it says how the session ended (a cut session's status or end).
    """
    rewards: dict[str, Reward] = {}
    for row, at in _rows(uri):
        session_id, value, task_id, status, end = (
            row.get(k) if isinstance(row, dict) else None
            for k in ("session_id", "reward", "task_id", "status", "end")
        )
        if not isinstance(session_id, str) or not session_id:
            raise RewardsError(f"rewards {uri} {at}: needs a string session_id")
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
        ):
            raise RewardsError(f"rewards {uri} {at}: reward must be a finite number, got {value!r}")
        if end is not None and end not in END_VALUES:
            raise RewardsError(f"rewards {uri} {at}: end {end!r} is none of {', '.join(END_VALUES)}")
        if value is None and status is None and end is None:
            continue  # nothing to join
        entry = Reward(
            None if value is None else float(value),
            None if task_id is None else str(task_id),
            None if status is None else str(status),
            end,
        )
        before = rewards.get(session_id, entry)
        if (before.reward, before.task_id) != (entry.reward, entry.task_id):
            raise RewardsError(f"rewards {uri} {at}: session {session_id!r} has two different rewards")
        rewards[session_id] = entry
    return rewards


def _rows(uri: str) -> list[tuple[Any, str]]:
    """The rows of a rewards file (JSONL or Parquet) with where each is (`row N`, `line N`) for errors."""
    fs, path = resolve_path(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise RewardsError(f"rewards {uri}: no such file")
    if info.type == pafs.FileType.Directory or path.endswith((".parquet", ".pq")):
        import pyarrow.dataset as ds

        try:
            rows = ds.dataset(path, format="parquet", filesystem=fs).to_table().to_pylist()
        except (OSError, pa.ArrowException) as exc:
            raise RewardsError(f"rewards {uri}: not a readable Parquet file ({one_line(exc)})") from exc
        return [(row, f"row {i + 1}") for i, row in enumerate(rows)]
    try:
        with fs.open_input_stream(path) as stream:
            lines = stream.read().decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise RewardsError(f"rewards {uri}: not UTF-8 text (byte {exc.start}); expected JSONL") from exc
    except OSError as exc:
        raise RewardsError(f"rewards {uri}: cannot be read ({one_line(exc)})") from exc
    found = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                found.append((orjson.loads(line), f"line {number}"))
            except orjson.JSONDecodeError as exc:
                raise RewardsError(f"rewards {uri} line {number}: not JSON ({exc})") from exc
    return found
