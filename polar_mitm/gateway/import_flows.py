"""`polar-mitm import-flows`: turn recorded mitmproxy flows into records.

Two kinds of flows carry token ids:
- flows that went through our gateway and were saved with `mitmdump -s addon/polar.py -w FILE`: the record
  travels in the flow's metadata (`polar_record`), so it is restored exactly;
- flows captured between a client and an SGLang engine (e.g. `mitmdump --mode reverse:http://ENGINE -w FILE`)
  whose responses carry `prompt_token_ids`/`response_token_ids`: the record is rebuilt from request + response.
Anything else is skipped and counted.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.codecs import ENGINE_CODEC
from polar_mitm.conversation import Completion
from polar_mitm.gateway.identity import scrub_headers
from polar_mitm.records import RECORD_SCHEMA, Record, journal_rows_to_table


def iter_flows(paths: Iterable[Path]) -> Iterator[Any]:
    from mitmproxy import http, io

    for path in paths:
        with open(path, "rb") as f:
            for flow in io.FlowReader(f).stream():
                if isinstance(flow, http.HTTPFlow):
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
        request_id=f"flow_{flow.id}", session_id=headers.get("x-polar-session") or f"flow-{flow.client_conn.id[:12]}",
        task_id=headers.get("x-polar-task"), seq=index, started_at=started, finished_at=finished,
        provider=ENGINE_CODEC.name, path=path, host=flow.request.pretty_host,
        stream=bool(request.get("stream")), model_requested=request.get("model"), model_used=completion.model,
        request_json=json.dumps(request, ensure_ascii=False),
        messages_json=json.dumps(request.get("messages"), ensure_ascii=False),
        tools_json=json.dumps(request.get("tools") or [], ensure_ascii=False),
        prompt_ids=completion.prompt_ids, completion_ids=completion.completion_ids,
        completion_logprobs=completion.completion_logprobs, finish_reason=completion.finish_reason,
        response_json=json.dumps(response, ensure_ascii=False), weight_version=completion.weight_version,
        status_code=flow.response.status_code, session_source="flow",
        prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens,
    )
    return record.to_journal()


def import_flows(paths: list[Path], out_dir: Path) -> tuple[Path | None, Counter]:
    """Write one Parquet shard of the records found in `paths`; return it and counts by outcome."""
    counts: Counter = Counter()
    rows: list[dict[str, Any]] = []
    for index, flow in enumerate(iter_flows(paths)):
        row = flow.metadata.get("polar_record")
        if row is not None:
            counts["gateway"] += 1
        else:
            row = record_from_engine_flow(flow, index)
            counts["engine" if row else "skipped"] += 1
        if row is not None:
            rows.append(row)
    if not rows:
        return None, counts
    table: pa.Table = journal_rows_to_table(rows).cast(RECORD_SCHEMA)
    out_dir.mkdir(parents=True, exist_ok=True)
    shard = out_dir / f"records-imported-{paths[0].stem}.parquet"
    pq.write_table(table, shard, compression="zstd")
    return shard, counts
