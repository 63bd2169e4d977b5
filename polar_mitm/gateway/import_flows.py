"""`polar-mitm import-flows`: turn recorded mitmproxy flows into records.

Two kinds of flows carry token ids:
- flows that went through our gateway and were saved with `mitmdump -s addon/polar.py -w FILE`: the record
  travels in the flow's metadata (`polar_record`), so it is restored exactly;
- flows captured between a client and an SGLang engine (e.g. `mitmdump --mode reverse:http://ENGINE -w FILE`)
  whose responses carry `prompt_token_ids`/`response_token_ids`: the record is rebuilt from request + response.
Anything else is skipped and counted.

A flow file is often what a killed mitmdump left: cut at an arbitrary byte. Every flow before the cut is imported,
and so is every good record when one flow's `polar_record` is not a record; after a corrupt region in the middle,
reading resumes at the next intact flow (`_next_flow`), so one bad region loses only the flows it covers. What
was not imported is named, one line each (`FlowImport.problems`), never hidden behind a traceback.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.codecs import ENGINE_CODEC
from polar_mitm.conversation import Completion
from polar_mitm.gateway.identity import scrub_headers
from polar_mitm.storage.location import FILE_MODE, one_line, private_dir
from polar_mitm.storage.records import Record, records_table


class FlowFileError(ValueError):
    """A flow file that cannot be read to its end (cut, corrupt, or not there)."""


@dataclass
class FlowImport:
    """What an import did: the shard written (None: no records), counts by outcome, what was not imported."""

    shard: Path | None
    counts: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # one line each: a file or flow, and why


_LENGTH_PREFIX = re.compile(rb"(\d*)(:?)")


def _why_unreadable(path: Path, offset: int, flows: int, exc: Exception) -> str:
    """One line for a flow file that stops reading at `offset`: cut (kill -9 of mitmdump), or corrupt there."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(offset)
        prefix = _LENGTH_PREFIX.match(f.read(13))
    assert prefix is not None  # the pattern matches the empty string
    digits, colon = prefix.groups()
    if not colon:  # cut inside the length prefix, or no length prefix at all
        cut = len(digits) == size - offset
    else:  # `<length>:<payload><type>`: cut when the file ends before the type byte
        cut = bool(digits) and offset + len(digits) + 1 + int(digits) + 1 > size
    if cut:
        return (
            f"{path}: file truncated after {flows} flows (an incomplete flow from byte {offset} to the end at "
            f"{size}); the rest was not imported"
        )
    return (
        f"{path}: unreadable after {flows} flows (corrupt data at byte {offset} of {size}: {one_line(exc)}); "
        f"the rest was not imported"
    )


def read_flow_file(path: Path, problems: list[str] | None = None) -> Iterator[tuple[int, Any]]:
    """(position in the file from 1, flow) of each HTTP flow of one `mitmdump -w` file.

    After a corrupt region reading resumes at the next intact flow, with a line naming the file and the bytes
    skipped; where it stops early (cut, corrupt to the end, unreadable) a line names the file, the number of flows
    read and the byte offset. Those lines go to `problems`; without `problems`, FlowFileError is raised instead.
    """
    from mitmproxy import http

    flows, offset = 0, 0
    try:
        with open(path, "rb") as f:
            while True:
                try:
                    for flow in _flows_from(f):
                        flows, offset = flows + 1, f.tell()
                        if isinstance(flow, http.HTTPFlow):
                            yield flows, flow
                    return
                except OSError:
                    raise
                except Exception as exc:  # corrupt bytes fail in tnetstring or in mitmproxy's flow state
                    resume = _next_flow(f, offset)
                    if resume is None:
                        line = _why_unreadable(path, offset, flows, exc)
                        break
                    _problem(
                        problems,
                        f"{path}: corrupt data from byte {offset} to {resume} after {flows} flows ({_reason(exc)}); "
                        f"skipped, reading resumed at the next intact flow",
                    )
                    f.seek(resume)
                    offset = resume
    except OSError as exc:
        line = f"{path}: cannot be read ({exc.strerror or exc}); not imported"
    _problem(problems, line)


def _problem(problems: list[str] | None, line: str) -> None:
    if problems is None:
        raise FlowFileError(line)
    problems.append(line)


def _reason(exc: Exception) -> str:
    cause = exc.__cause__ or exc
    return f"{type(cause).__name__}: {one_line(cause)}"


def _flows_from(f: BinaryIO) -> Iterator[Any]:
    """The flows from the file's position on, read by mitmproxy's own reader."""
    from mitmproxy import io

    yield from io.FlowReader(f).stream()


# A flow is a tnetstring dict: `<length>:` then its first key, itself a tnetstring (`<length>:<key>,`). A lookahead,
# so that digits ending a corrupt region do not hide the flow right behind them.
_FLOW_START = re.compile(rb"(?=(\d{1,12}):\d{1,12}:)")


def _next_flow(f: BinaryIO, after: int) -> int | None:
    """Where the next intact flow after byte `after` starts (one that mitmproxy reads whole), or None."""
    from mitmproxy import io

    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
    try:
        for found in _FLOW_START.finditer(data, after + 1):
            start = found.start()
            end = start + len(found.group(1)) + 1 + int(found.group(1))
            if end >= len(data) or data[end : end + 1] != b"}":  # a dict's payload ends in its type byte
                continue
            try:
                next(iter(io.FlowReader(BytesIO(data[start : end + 1])).stream()))
            except Exception:  # not a flow after all: a number inside the corrupt region or a flow's body
                continue
            return start
        return None
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def iter_flows(paths: Iterable[Path], problems: list[str] | None = None) -> Iterator[Any]:
    """The HTTP flows of every file in `paths` (see `read_flow_file` for files that stop early)."""
    for path in paths:
        for _, flow in read_flow_file(Path(path), problems):
            yield flow


def record_from_engine_flow(flow, index: int) -> dict[str, Any] | None:
    """A record from an SGLang chat exchange, or None if the response carries no token ids."""
    path = flow.request.path.split("?")[0]
    if flow.response is None or not ENGINE_CODEC.matches(path):
        return None
    try:
        request = json.loads(flow.request.get_text() or "")
        response = json.loads(flow.response.get_text() or "")
        completion = Completion.from_engine_response(response)
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    headers = {k.lower(): v for k, v in scrub_headers(dict(flow.request.headers)).items()}
    started = datetime.fromtimestamp(flow.request.timestamp_start, tz=UTC)
    finished = datetime.fromtimestamp(flow.response.timestamp_end or flow.request.timestamp_start, tz=UTC)
    record = Record(
        request_id=f"flow_{flow.id}",
        session_id=headers.get("x-polar-session") or f"flow-{flow.client_conn.id[:12]}",
        task_id=headers.get("x-polar-task"),
        seq=index,
        started_at=started,
        finished_at=finished,
        provider=ENGINE_CODEC.name,
        path=path,
        host=flow.request.pretty_host,
        stream=bool(request.get("stream")),
        model_requested=request.get("model"),
        model_used=completion.model,
        request_json=json.dumps(request, ensure_ascii=False),
        messages_json=json.dumps(request.get("messages"), ensure_ascii=False),
        tools_json=json.dumps(request.get("tools") or [], ensure_ascii=False),
        prompt_ids=completion.prompt_ids,
        completion_ids=completion.completion_ids,
        completion_logprobs=completion.completion_logprobs,
        finish_reason=completion.finish_reason,
        response_json=json.dumps(response, ensure_ascii=False),
        weight_version=completion.weight_version,
        status_code=flow.response.status_code,
        session_source="flow",
        prompt_tokens=completion.prompt_tokens,
        completion_tokens=completion.completion_tokens,
    )
    return record.to_journal()


def import_flow_files(paths: list[Path], out_dir: Path) -> FlowImport:
    """Write one Parquet shard of every record found in `paths`; name each file or flow that was not imported.

    Counts: `gateway` and `engine` records imported, `skipped` flows that carry no record, `rejected` flows whose
    record does not validate. A cut or corrupt file yields the flows before the damage.
    """
    result = FlowImport(shard=None)
    rows: list[dict[str, Any]] = []
    origin: dict[int, tuple[str, str]] = {}  # id(row) → (its kind, the flow that carried it)
    index = 0  # across files: an engine flow's seq
    for path in paths:
        for position, flow in read_flow_file(Path(path), result.problems):
            row, kind = flow.metadata.get("polar_record"), "gateway"
            if row is None:
                row, kind = record_from_engine_flow(flow, index), "engine"
            index += 1
            if row is None:
                result.counts["skipped"] += 1
                continue
            result.counts[kind] += 1
            rows.append(row)
            origin[id(row)] = (kind, f"{path}: flow {position} (id {flow.id})")
    table, rejected = records_table(rows)
    for row, reason in rejected:
        kind, which = origin[id(row)]
        result.counts[kind] -= 1
        result.counts["rejected"] += 1
        what = "its polar_record" if kind == "gateway" else "the record rebuilt from it"
        result.problems.append(f"{which}: {what} does not validate ({reason}); not imported")
    if table.num_rows:
        result.shard = _write_shard(table, out_dir, paths[0].stem)
    return result


def _write_shard(table: pa.Table, out_dir: Path, name: str) -> Path:
    """Atomically: a reader never sees half a shard, and a failed import leaves no partial file behind."""
    private_dir(out_dir)
    shard = out_dir / f"records-imported-{name}.parquet"
    tmp = out_dir / f".{shard.name}.tmp"
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.chmod(tmp, FILE_MODE)  # records are their owner's only
        os.replace(tmp, shard)
    finally:
        tmp.unlink(missing_ok=True)
    return shard


def import_flows(paths: list[Path], out_dir: Path) -> tuple[Path | None, Counter]:
    """`import_flow_files` for callers that want the shard and the counts only (what was not imported is still
    counted: `rejected`; a file that stops early is not)."""
    result = import_flow_files(paths, out_dir)
    return result.shard, result.counts
