"""Offline tests on recorded flows (sample_flows/): codecs replay them, import-flows rebuilds their records."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.codecs import CODECS, detect
from polar_mitm.gateway.import_flows import import_flows, iter_flows

SAMPLES = Path(__file__).resolve().parents[2] / "sample_flows"
FLOW_FILE = SAMPLES / "sdk_sessions.flow"
pytestmark = pytest.mark.skipif(not FLOW_FILE.exists(), reason="run scripts/record_sample_flows.py")


def model_flows():
    return [f for f in iter_flows([FLOW_FILE]) if "polar_record" in f.metadata]


def test_flows_hold_every_provider_and_no_secret():
    flows = model_flows()
    # Every provider API (the compaction endpoint records as the Responses provider it belongs to).
    assert {f.metadata["polar_record"]["provider"] for f in flows} == {
        codec.name for codec in CODECS.values()
    }
    raw = FLOW_FILE.read_bytes()
    assert b"sk-sample-not-a-secret" not in raw
    for f in flows:
        assert not {"authorization", "x-api-key", "x-goog-api-key"} & {k.lower() for k in f.request.headers}


def test_codecs_decode_recorded_requests_exactly_as_recorded():
    for flow in model_flows():
        record = flow.metadata["polar_record"]
        path = record["path"]
        body = json.loads(flow.request.get_text())
        codec = detect(path, {k.lower(): v for k, v in flow.request.headers.items()}, body)
        assert codec is not None and codec.name == record["provider"]
        conv = codec.decode_request(body, path, dict(flow.request.query.items()))
        assert conv.messages_json() == json.loads(record["messages_json"])
        assert codec.stream_requested(body, path, dict(flow.request.query.items())) == record["stream"]


def test_recorded_answers_parse_with_the_official_sdks():
    import anthropic.types as at
    import openai.types.chat as oc
    import openai.types.responses as orr
    from google.genai import types as gt

    validators = {
        "anthropic": at.Message,
        "openai_chat": oc.ChatCompletion,
        "openai_responses": orr.Response,
        "google": gt.GenerateContentResponse,
    }
    for flow in model_flows():
        record = flow.metadata["polar_record"]
        validators[record["provider"]].model_validate(json.loads(record["response_json"]))
        if record["stream"]:
            assert flow.response.headers["content-type"].startswith("text/event-stream")
            events = [line for line in flow.response.get_text().splitlines() if line.startswith("data: ")]
            assert events
        else:
            assert json.loads(flow.response.get_text()) == json.loads(record["response_json"])


def test_import_flows_rebuilds_the_recorded_records(tmp_path):
    shard, counts = import_flows([FLOW_FILE], tmp_path)
    imported = pq.read_table(shard).to_pylist()
    recorded = pq.read_table(SAMPLES / "records" / "sdk_sessions.parquet").to_pylist()
    assert counts["gateway"] == len(recorded) == len(imported)
    key = {r["request_id"]: r for r in recorded}
    for row in imported:
        original = key[row["request_id"]]
        for col in ("session_id", "seq", "prompt_ids", "completion_ids", "finish_reason", "weight_version"):
            assert row[col] == original[col]
        assert row["completion_logprobs"] == pytest.approx(original["completion_logprobs"])
