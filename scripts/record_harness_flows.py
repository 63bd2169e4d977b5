"""Record `sample_flows/harness/`: one multi-turn session per real harness CLI, through the real gateway.

Each harness runs in proxy mode (its first-party request shape) against the scripted tiny engine: think, run
`echo hello > out.txt`, run `cat out.txt`, answer. Claude Code then continues the session with `/compact`, a real
compaction turn. Writes sample_flows/harness/<name>.flow (mitmproxy `save_stream_file`: every flow, side traffic
included, credentials scrubbed, records in flow metadata) and sample_flows/harness/<name>.parquet (the records).

Run: .venv/bin/python scripts/record_harness_flows.py [NAME ...]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.harness import HARNESSES
from polar_mitm.harness.aider import FAIL_ONCE_ARGS
from polar_mitm.harness.policy import shell_script
from polar_mitm.harness.stack import HarnessStack
from polar_mitm.storage.records import RECORD_SCHEMA

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "sample_flows" / "harness"
SCRIPT = shell_script(["echo hello > out.txt", "cat out.txt"], "Done: out.txt says hello.")
PROMPT = "Write hello into out.txt, then check it."
TASK = "sample-hello"
FOLLOW_UPS = {"claude-code": [("/compact", ["--continue"])]}  # (prompt, extra args) run in the same session
FIRST_ARGS = {"aider": FAIL_ONCE_ARGS}  # no tools: its test loop gives the session a second call


def record(name: str, tmp: Path) -> None:
    harness = HARNESSES[name]
    flow_file = tmp / f"{name}.flow"
    stack = HarnessStack.start(tmp / name, SCRIPT, gateway_options={"save_stream_file": str(flow_file)})
    session = f"sample-{name}"
    try:
        runs = [(PROMPT, FIRST_ARGS.get(name, []))] + FOLLOW_UPS.get(name, [])
        for prompt, args in runs:
            run = stack.run(
                harness,
                prompt,
                mode="proxy",
                session=session,
                task=TASK,
                workspace=tmp / name / "work",
                home=tmp / name / "home",
                args=args,
            )
            if run.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{run.describe()}")
        rows = stack.records(session)
    finally:
        stack.stop()
    shutil.copy(flow_file, OUT / f"{name}.flow")
    table = pa.Table.from_pylist([{**r} for r in rows], schema=RECORD_SCHEMA)
    pq.write_table(table, OUT / f"{name}.parquet", compression="zstd")
    print(f"{name}: {len(rows)} records ({stack.isolation}) → {OUT / name}.{{flow,parquet}}")


def main(names: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="polar-harness-flows-") as tmp:
        for name in names or list(HARNESSES):
            record(name, Path(tmp))


if __name__ == "__main__":
    main(sys.argv[1:])
