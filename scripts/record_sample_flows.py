"""Record `sample_flows/`: real SDK sessions through the real gateway, against the scripted tiny engine.

Writes sample_flows/sdk_sessions.flow (mitmdump -w, secrets scrubbed, records in flow metadata) and
sample_flows/records/sdk_sessions.parquet. Run: .venv/bin/python scripts/record_sample_flows.py
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from polar_mitm.agent.sdk_agent import DRIVERS, base_url_for
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.session_ids import SessionId

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = [
    {
        "text": "I'll create the file.",
        "tool_call": {"name": "shell", "arguments": {"command": "echo hello > out.txt"}},
    },
    {"tool_call": {"name": "shell", "arguments": {"command": "cat out.txt"}}},
    "Done: out.txt contains hello.",
]


def main() -> None:
    out = ROOT / "sample_flows"
    (out / "records").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "script.json").write_text(json.dumps(SCRIPT))
        flow_file = tmp_path / "sdk_sessions.flow"
        with gateway_processes.engine_and_gateway(
            tmp_path / "flows",
            confdir=tmp_path / "conf",
            engine_args=["--script", str(tmp_path / "script.json")],
            gateway_options={"save_stream_file": str(flow_file)},
        ) as (_, gw):
            for provider, driver in DRIVERS.items():
                for stream in (False, True):
                    session = f"sample-{provider}-{'stream' if stream else 'plain'}"
                    base = base_url_for(
                        provider, gw.reverse_url, SessionId(session, "sample-task").path_prefix
                    )
                    result = driver(
                        "Write hello into out.txt, then check it.",
                        api_key="sk-sample-not-a-secret",
                        base_url=base,
                        stream=stream,
                    )
                    print(f"{session}: {result.calls} calls, final={result.final_text!r}")
        shutil.copy(flow_file, out / "sdk_sessions.flow")
        shards = sorted((tmp_path / "flows").glob("records-*.parquet"))
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.concat_tables([pq.read_table(s) for s in shards])
        pq.write_table(table, out / "records" / "sdk_sessions.parquet", compression="zstd")
        print(f"{table.num_rows} records → {out / 'records' / 'sdk_sessions.parquet'}")


if __name__ == "__main__":
    main()
