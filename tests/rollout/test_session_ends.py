"""Every way a session ends, produced for real: a harness (a Python client through the gateway, as any harness)
ends the way its task's prompt says — a max_tokens cut, a malformed tool call from the scripted engine, a prompt
past the engine's context, killed by its timeout, a crash, an engine that is down, a straggler cut — and its rewards
row, its merged sequences and its service traces say so; the loop's rules (`LoopConfig.end_rules`, applied by the
merge the loop runs) mask, zero or keep each and count them.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.loop.config import LoopConfig
from polar_mitm.processes import ports
from polar_mitm.reconstruct.merge import merge
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig, RolloutSummary, settle_ends, write_rewards
from polar_mitm.service.traces import flows_eot, merged_sequence, session_traces
from polar_mitm.storage.merged import read_merged
from polar_mitm.tasks.task_file import Task, Timeouts

# The harness: one call (the task's prompt) through the gateway, then what its case says. An HTTP error ends it
# with exit 1, as real harnesses end on an API error they do not handle.
HARNESS = """
import json, sys, time, urllib.error, urllib.request

prompt, base, index = sys.argv[1], sys.argv[2], int(sys.argv[3])
case = prompt.split(":", 1)[1]
TOOLS = [{"type": "function", "function": {"name": "shell", "description": "Run a command.",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


def call(content, max_tokens=48):
    body = {"model": "m", "max_tokens": max_tokens, "tools": TOOLS,
            "messages": [{"role": "user", "content": content}]}
    request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        return json.load(urllib.request.urlopen(request, timeout=60))
    except urllib.error.HTTPError:
        sys.exit(1)


if case == "cut" and index >= 1:
    time.sleep(60)
call(prompt, max_tokens=4 if case == "length" else 48)
if case == "overflow":
    call("word " * 600)
if case == "timeout":
    time.sleep(60)
if case == "crash":
    sys.exit(3)
open("out.txt", "w").write("done\\n")
"""
SCRIPT = {
    "turns": ["Done."],
    "replies": [
        # longer than any completion budget here (the loop's --max-tokens too)
        {"when": "case:length", "text": " ".join(["Counting on and on."] * 40)},
        {
            "when": "case:unparsed",
            "text": '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"\n</tool_call>',
        },
    ],
}
# case → the end its sessions must have
ENDS = {
    "completed": "completed",
    "length": "length",
    "unparsed": "unparsed_tool_call",
    "overflow": "context_overflow",
    "timeout": "harness_timeout",
    "crash": "harness_crash",
}


@pytest.fixture(scope="module")
def ends_gateway(tmp_path_factory):
    """The scripted tiny engine with a 512-token context, and a gateway in front of it."""
    root = tmp_path_factory.mktemp("ends")
    (root / "script.json").write_text(json.dumps(SCRIPT))
    with gateway_processes.engine_and_gateway(
        root / "flows",
        confdir=root / "conf",
        engine_args=["--script", str(root / "script.json"), "--context-length", "512"],
        engine_log=root / "engine.log",
        gateway_log=root / "gateway.log",
    ) as (_, gw):
        yield gw


def rolled(root: Path, cases: list[str], gateway, **config) -> RolloutSummary:
    """The cases' sessions (the harness in each workspace) through `gateway`, their ends settled from its records;
    the `timeout` case's harness has 8 s."""
    (root / "src").mkdir(parents=True)
    (root / "src" / "harness.py").write_text(HARNESS)
    tasks = [
        Task(
            task_id=case,
            prompt=f"case:{case}",
            eval_command="test -f out.txt",
            workspace_dir=root / "src",
            timeouts=Timeouts(run=8 if case == "timeout" else 60),  # time for its call on a loaded machine
        )
        for case in cases
    ]
    settings = RolloutConfig(workspace_root=root / "ws", log_dir=root / "logs", concurrency=12, **config)
    harness = HarnessSpec(f"cmd:{sys.executable} harness.py {{prompt}} {{base_url}} {{index}}")
    endpoints = GatewayEndpoints(gateway.reverse_url, gateway.proxy_url)
    summary = asyncio.run(Rollout(tasks, harness, endpoints, settings).run())
    settle_ends(summary.sessions, gateway.out_dir)
    return summary


@pytest.fixture(scope="module")
def ended(ends_gateway, tmp_path_factory):
    """Every end: the cases above (2 sessions each, side by side), a straggler cut (--keep 1) and an engine that is
    down; one rewards file for all."""
    root = tmp_path_factory.mktemp("ended")
    cases = rolled(root / "cases", list(ENDS), ends_gateway, group_size=2, init_workers=4)
    cut = rolled(root / "cut", ["cut"], ends_gateway, group_size=2, keep=1)
    dead = gateway_processes.start_gateway(
        f"http://127.0.0.1:{ports.free_port()}", root / "dead-flows", confdir=root / "dead-conf"
    )
    try:
        down = rolled(root / "down", ["completed"], dead, group_size=1)
    finally:
        dead.stop()
    sessions = cases.sessions + cut.sessions + down.sessions
    write_rewards(RolloutSummary(sessions, 0.0, 0.0), root / "rewards.parquet")
    return root, sessions, ends_gateway, dead, {s.session_id for s in down.sessions}


def test_every_end_is_on_its_sessions_rewards_row_beside_the_runner_status(ended):
    root, sessions, _, _, down = ended
    rows = pq.read_table(root / "rewards.parquet").to_pylist()
    # The engine was down: the harness exited 1 on the 503, and its last call's error decides over the crash.
    assert [(r["status"], r["end"]) for r in rows if r["session_id"] in down] == [("crashed", "engine_error")]
    for case, end in ENDS.items():
        found = {
            (r["status"], r["end"]) for r in rows if r["task_id"] == case and r["session_id"] not in down
        }
        status = {"timeout": "timeout", "crash": "crashed", "overflow": "crashed"}.get(case, "ok")
        assert found == {(status, end)}, (case, found)
    cut = sorted((r["sample_index"], r["status"], r["end"]) for r in rows if r["task_id"] == "cut")
    assert cut == [(0, "ok", "completed"), (1, "cut", "cut")]
    assert {s.session_id: s.end for s in sessions} == {r["session_id"]: r["end"] for r in rows}


def test_the_loops_rules_mask_zero_or_keep_each_end_where_merge_joins_rewards(ended):
    root, _, gateway, dead, _ = ended
    rules = LoopConfig(tasks=root / "unused.jsonl", run_dir=root / "run").end_rules()  # the loop's defaults
    summary = merge(
        [str(gateway.out_dir), str(dead.out_dir)],
        str(root / "merged"),
        rewards=str(root / "rewards.parquet"),
        drop_unrewarded=True,
        end_rules=rules,
    )
    merged = read_merged(root / "merged", columns=["session_id", "task_id", "reward", "end"]).to_pylist()
    trained = {(r["task_id"], r["end"], r["reward"]) for r in merged}
    # keep: completed and length with their rewards; zero: the unparsed call's 1.0, the timeout's and the crash's
    # failure rewards; mask: the overflow (its first call was fine, so it had a sequence to leave out).
    assert trained == {
        ("completed", "completed", 1.0),
        ("cut", "completed", 1.0),
        ("length", "length", 1.0),
        ("unparsed", "unparsed_tool_call", 0.0),
        ("timeout", "harness_timeout", 0.0),
        ("crash", "harness_crash", 0.0),
    }
    assert summary.end_rules == {
        "context_overflow:mask": 2,
        "harness_crash:zero": 2,
        "harness_timeout:zero": 2,
        "length:keep": 2,
        "unparsed_tool_call:zero": 2,
    }
    assert summary.masked_sequences >= 2
    # every session with records, by its end (the engine-down one has an error record and nothing to train; the
    # cut one was stopped before its first call)
    assert summary.session_ends == {
        "harness_timeout": 2,
        "engine_error": 1,
        "context_overflow": 2,
        "harness_crash": 2,
        "length": 2,
        "unparsed_tool_call": 2,
        "completed": 3,
    }


def test_a_service_trace_says_its_sessions_end_and_keeps_the_engines_reason(ended):
    _, sessions, gateway, _, _ = ended
    timed_out = next(s for s in sessions if s.task.task_id == "timeout")
    [trace] = session_traces(
        gateway.out_dir, timed_out.session_id, 0.0, "prefix_merging", flows_eot(gateway.out_dir), "timeout"
    )
    assert trace.finish_reason == "harness_timeout" and trace.metadata["engine_finish_reason"] == "stop"
    assert merged_sequence(trace).end == "harness_timeout" and merged_sequence(trace).finish_reason == "stop"
    cut_short = next(s for s in sessions if s.task.task_id == "length")
    [trace] = session_traces(
        gateway.out_dir, cut_short.session_id, 1.0, "prefix_merging", flows_eot(gateway.out_dir)
    )
    assert trace.finish_reason == "length" == trace.metadata["engine_finish_reason"]
