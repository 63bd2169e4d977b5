"""The tool-call parse failure rate per harness (issue 42 §2): of the turns a model sampled through a real harness,
how many look like a tool call, how many of those the engine's parser read, and how many it could not.

Why: peers lose rollouts to tool calls the parser could not read (verifiers #2027: 186 of 600), and a session that
ends on one is `unparsed_tool_call` (polar_mitm/storage/session_ends.py), which the loop's rule zeroes or masks.
This measures how often that happens, per harness, under two policies:

- `scripted`: the scripted policy (polar_mitm/harness/policy.py `shell_script`) on the tiny engine — every tool
  call is well formed, so the expected rate is 0%: the baseline that shows the measurement counts right;
- `smollm2`: SmolLM2-135M-Instruct on the embedded engine, sampling freely (temperature 1, a max_tokens cap, a
  per-session timeout). Its context is 8k tokens: a harness whose first prompt is longer gets "prompt over
  context" (the engine's own context_length error, read from the records), not a rate.

Each session is a real harness CLI (or the SDK reference agent, `sdk`) given a small file task, through the
gateway, which records every call. A turn is a recorded call the model sampled (not aborted, no engine error),
among the session's main calls (those offering tools; all its calls for a harness that offers none, Aider). It
*looks like a tool call* when the parser read one (finish_reason `tool_calls`) or when a tool call was left in the
answer as text — session_ends.unparsed_tool_call decides that (the same test that ends a session
`unparsed_tool_call`); it is *unparsed* in the second case. `cut` counts the unparsed ones whose answer hit
max_tokens (a call cut before its end: the budget's doing). A session's end is session_ends.session_end.

    .venv/bin/python benchmarks/bench_tool_call_parsing.py                     # both policies, every harness
    .venv/bin/python benchmarks/bench_tool_call_parsing.py --policy smollm2 --harness pi --harness sdk -n 2

Harnesses not installed (scripts/setup-<name>.sh) are listed as such; with --budget-s, the harnesses left when it
runs out are listed as not run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from polar_mitm.codecs import sdk_base_url  # noqa: E402
from polar_mitm.gateway import processes as gateway_processes  # noqa: E402
from polar_mitm.harness import HARNESSES  # noqa: E402
from polar_mitm.harness.base import base_environment  # noqa: E402
from polar_mitm.harness.netns import try_namespace  # noqa: E402
from polar_mitm.harness.policy import shell_script  # noqa: E402
from polar_mitm.harness.stack import HarnessRun, HarnessStack  # noqa: E402
from polar_mitm.storage.records import RECORD_SCHEMA, read_all  # noqa: E402
from polar_mitm.storage.session_ends import (  # noqa: E402
    ABORT_FINISH,
    OVERFLOW_ERROR_KIND,
    SessionEnd,
    recorded_calls,
    session_end,
    status_end,
    unparsed_tool_calls,
)

SDK = "sdk"  # the SDK reference agent (polar_mitm/agent/sdk_agent.py, openai_chat), run as `polar-mitm rollout` does
PROMPT = "Create a file out.txt that contains the single line: hello"
COMMANDS = ["echo hello > out.txt", "cat out.txt"]
FINAL = "Done: out.txt says hello."
TASK = "hello-file"
POLICIES = ("scripted", "smollm2", "malformed")
DEFAULT_POLICIES = ("scripted", "smollm2")
# The positive control (`--policy malformed`): the scripted policy whose first answer is a tool call the parser
# cannot read (its JSON left open), so the harness gets it as text — every session must count it and end on it.
MALFORMED_CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>'


@dataclass
class Tally:
    """One harness under one policy, summed over its sessions."""

    sessions: int = 0
    turns: int = 0
    parsed: int = 0
    unparsed: int = 0
    cut: int = 0  # unparsed turns whose answer hit max_tokens
    over_context: int = 0  # calls the engine refused: the prompt was longer than its context
    first_over_context: int = 0  # sessions whose first main call was refused so
    ends: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    note: str = ""  # "not installed", "not run: …"

    @property
    def looks_like(self) -> int:
        return self.parsed + self.unparsed


def main_calls(rows: list[dict]) -> list[dict]:
    """The agent loop's calls (offering tools); all calls for a harness that offers none (Aider)."""
    return (
        [r for r in rows if r.get("call_kind") == "main"]
        or [r for r in rows if r.get("call_kind") != "side"]
        or rows
    )


def overflowed(row: dict) -> bool:
    """The engine refused the call: its prompt was longer than the context."""
    return (row.get("error") or "").split(":", 1)[0].strip() == OVERFLOW_ERROR_KIND


def count_session(tally: Tally, run: HarnessRun, rows: list[dict]) -> None:
    """Add one session's turns and end to `tally`."""
    rows = sorted(rows, key=lambda r: (r["seq"], r["started_at"]))
    main = main_calls(rows)
    unparsed = dict(
        zip(
            (id(r) for r in main),
            unparsed_tool_calls(pa.array([r["response_json"] for r in main], pa.string())),
            strict=True,
        )
    )
    tally.over_context += sum(overflowed(r) for r in rows)
    tally.first_over_context += bool(main) and overflowed(main[0])
    for row in main:
        if row["finish_reason"] in (ABORT_FINISH, "error") or row.get("error"):
            continue  # nothing sampled
        tally.turns += 1
        if unparsed[id(row)]:
            tally.unparsed += 1
            tally.cut += row["finish_reason"] == "length"
        elif row["finish_reason"] == "tool_calls":
            tally.parsed += 1
    # Typed by the records' schema: a session whose answers are all null still has a string response_json.
    calls = (
        recorded_calls(pa.Table.from_pylist(rows, schema=RECORD_SCHEMA)).get(run.session, []) if rows else []
    )
    status = "timeout" if run.returncode == -9 else ("crashed" if run.returncode != 0 else None)
    end = str(session_end(status_end(status), calls))
    tally.ends[end] = tally.ends.get(end, 0) + 1
    tally.sessions += 1
    tally.wall_s += run.wall_s


def run_sdk_agent(stack: HarnessStack, session: str, workspace: Path, timeout: float) -> HarnessRun:
    """The SDK reference agent on openai_chat, through the gateway's reverse listener, as `rollout --harness sdk`."""
    workspace.mkdir(parents=True, exist_ok=True)
    hookup = stack.hookup("base-url", session, TASK)
    argv = [sys.executable, "-m", "polar_mitm.agent.cli", "--provider", "openai_chat"]
    argv += [
        "--base-url",
        sdk_base_url("openai_chat", hookup.base_url()),
        "--workdir",
        str(workspace),
        "--",
        PROMPT,
    ]
    started = time.monotonic()
    try:
        done = subprocess.run(
            stack.netns.wrap(argv) if stack.netns else argv,
            cwd=workspace,
            env={**base_environment(), "POLAR_AGENT_API_KEY": hookup.api_key},
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = -9, str(exc.stdout or ""), f"[timed out after {timeout:.0f}s]"
    return HarnessRun(argv, code, out, err, time.monotonic() - started, session, workspace)


def start_stack(root: Path, policy: str, args: argparse.Namespace) -> HarnessStack:
    """The engine (tiny + the scripted policy, or SmolLM2) and a gateway, in a private namespace where possible."""
    if policy == "scripted":
        return HarnessStack.start(root, shell_script(COMMANDS, FINAL))
    if policy == "malformed":
        script = shell_script(COMMANDS, FINAL)
        return HarnessStack.start(root, {**script, "turns": [MALFORMED_CALL, FINAL]})
    netns, isolation = try_namespace()
    with ExitStack() as running:
        if netns is not None:
            running.callback(netns.close)
        _, gateway = running.enter_context(
            gateway_processes.engine_and_gateway(
                root / "flows",
                confdir=root / "conf",
                model="smollm2",
                engine_args=["--threads", str(args.engine_threads)] if args.engine_threads else None,
                engine_log=root / "engine.log",
                gateway_log=root / "gateway.log",
                gateway_options={
                    "polar_max_tokens": str(args.max_tokens),
                    "polar_temperature": str(args.temperature),
                },
                netns=netns,
            )
        )
        return HarnessStack(
            root=root, netns=netns, isolation=isolation, gateway=gateway, running=running.pop_all()
        )


def installed(name: str) -> bool:
    return name == SDK or HARNESSES[name].installed_version() is not None


def measure(policy: str, names: list[str], args: argparse.Namespace, deadline: float) -> dict[str, Tally]:
    """N sessions of each harness under `policy`; harnesses not installed, or left when the budget ran out, noted."""
    tallies = {name: Tally() for name in names}
    for name in names:
        if not installed(name):
            tallies[name].note = f"not installed (scripts/setup-{name}.sh)"
    todo = [name for name in names if not tallies[name].note]
    if not todo:
        return tallies
    root = Path(tempfile.mkdtemp(prefix=f"bench-tool-calls-{policy}-"))
    stack = start_stack(root, policy, args)
    timeout = args.timeout if policy == "smollm2" else args.scripted_timeout
    try:
        for name in todo:
            for k in range(args.sessions):
                if time.monotonic() + min(timeout, 30) > deadline:
                    tallies[name].note = tallies[name].note or "not run: time budget spent"
                    break
                session = f"{name}-{policy}-{k}-{uuid.uuid4().hex[:6]}"
                work = root / session
                budget = min(timeout, max(deadline - time.monotonic(), 1.0))
                if name == SDK:
                    run = run_sdk_agent(stack, session, work / "work", budget)
                else:
                    run = stack.run(
                        HARNESSES[name], PROMPT, mode="proxy", session=session, task=TASK,
                        workspace=work / "work", home=work / "home", timeout=budget,
                    )  # fmt: skip
                count_session(tallies[name], run, rows_of(stack, session))
                print(
                    f"  {policy:8} {name:15} session {k + 1}: exit {run.returncode} in {run.wall_s:.0f}s",
                    flush=True,
                )
    finally:
        stack.stop()
    return tallies


def rows_of(stack: HarnessStack, session: str) -> list[dict]:
    return [r for r in read_all(stack.gateway.out_dir).to_pylist() if r["session_id"] == session]


def table(policy: str, tallies: dict[str, Tally], args: argparse.Namespace) -> list[str]:
    what = {
        "scripted": "scripted policy (tiny engine)",
        "malformed": "positive control: a scripted first answer holding a malformed <tool_call> (tiny engine)",
    }.get(policy) or (
        f"SmolLM2-135M sampling freely (T={args.temperature}, max_tokens={args.max_tokens}, "
        f"{args.timeout:.0f} s a session, 8k context)"
    )
    lines = [
        f"tool-call parsing, {what}:",
        f"{'harness':15} {'sessions':>8} {'turns':>5} {'tool-call-like':>14} {'parsed':>6} {'unparsed':>8} "
        f"{'(cut)':>5} {'rate':>6} {'ended unparsed':>14}  ends",
    ]
    for name, t in tallies.items():
        if t.note and not t.sessions:
            lines.append(f"{name:15} {t.note}")
            continue
        if t.first_over_context == t.sessions and t.turns == 0:
            lines.append(f"{name:15} {t.sessions:>8} prompt over context (the engine refused its first call)")
            continue
        rate = f"{t.unparsed / t.looks_like:6.1%}" if t.looks_like else f"{'—':>6}"
        ended = t.ends.get(str(SessionEnd.UNPARSED_TOOL_CALL), 0)
        ends = ", ".join(f"{n} {end}" for end, n in t.ends.items())
        extra = f"; {t.note}" if t.note else ""
        lines.append(
            f"{name:15} {t.sessions:>8} {t.turns:>5} {t.looks_like:>14} {t.parsed:>6} {t.unparsed:>8} "
            f"{t.cut:>5} {rate} {ended:>14}  {ends}{extra}"
        )
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--policy", choices=POLICIES, action="append", help="repeatable (default: scripted, smollm2)"
    )
    parser.add_argument(
        "--harness", action="append", choices=[SDK, *HARNESSES], help="repeatable (default: all)"
    )
    parser.add_argument("-n", "--sessions", type=int, default=1, help="sessions per harness and policy")
    parser.add_argument("--max-tokens", type=int, default=96, help="SmolLM2: completion budget of every call")
    parser.add_argument("--temperature", type=float, default=1.0, help="SmolLM2: sampling temperature")
    parser.add_argument("--timeout", type=float, default=150.0, help="SmolLM2: seconds a session")
    parser.add_argument("--scripted-timeout", type=float, default=300.0, help="scripted: seconds a session")
    parser.add_argument(
        "--engine-threads", type=int, default=None, help="SmolLM2: torch threads (default: all cores)"
    )
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting sessions after this long")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    names = args.harness or [SDK, *HARNESSES]
    deadline = time.monotonic() + (args.budget_s if args.budget_s else float("inf"))
    lines: list[str] = []
    for policy in args.policy or list(DEFAULT_POLICIES):
        tallies = measure(policy, names, args, deadline)
        lines += [*table(policy, tallies, args), ""]
        text = "\n".join(lines)
        print("\n" + text, flush=True)
        if args.out:  # after each policy: a later one cut short leaves the earlier tables
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)


if __name__ == "__main__":
    main()
