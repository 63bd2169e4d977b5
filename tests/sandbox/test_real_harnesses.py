"""Real harnesses through `polar-mitm rollout --sandbox bwrap` (issue 41): the SDK agent, the six unmodified npm
CLIs (proxy mode: HTTPS_PROXY and the CA bundle through the sandbox's tunnel), the four with installs of their own
and Aider — with mini-swe-agent and OpenHands (tests/harness/test_swe_harnesses.py), all 13 — finish the scripted
session in their sandboxed workspace, the evaluation runs in the same sandbox and passes, and every sampled token is
still trained in the exact context it was sampled in (100% context-exact). A Harbor task goes the same way, graded
by its own verifier.

This is each CLI's one proxy-mode, tokens-mode session of the suite: every property tests/harness/test_harnesses.py
checks on that session (the API, every call recorded in full, the tool calls parsed and answered, the harness's
quirks, true logprobs, one merged main thread) is checked here on the rollout's records by its `check_session`.
A closing table gives the context-exact tokens per harness."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from polar_mitm.engines import processes as engine_processes
from polar_mitm.harness import get_harness
from polar_mitm.harness.policy import shell_script
from polar_mitm.storage.records import read_all

# The same scripted session as test_harnesses' (check_session counts its commands and reads its final answer).
from tests.harness.test_harnesses import (
    COMMANDS,
    FINAL,
    PROXY_SESSION_IN_BWRAP,
    SCRIPT,
    check_session,
    fidelity,
)
from tests.summary_tables import show_table
from tests.tasks.test_swe_tasks import rollout_cli


def policy(harness: str) -> dict:
    """The scripted shell session; the SDK agent's `shell` takes a string (Codex's tool of that name a list)."""
    if not harness.startswith("sdk:"):
        return SCRIPT
    calls = [
        {"text": f"Running `{c}`.", "tool_call": {"name": "shell", "arguments": {"command": c}}}
        for c in COMMANDS
    ]
    return {"turns": [*calls, FINAL]}


NPM_PRESETS = ["pi", "claude-code", "codex", "gemini", "qwen", "opencode"]
OWN_INSTALLS = [
    "cline",
    "kilo",
    "hermes",
    "openclaw",
    "aider",
]  # scripts/setup-<name>.sh: a prefix or venv each
EXACT: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def exactness_table(request):
    yield
    if EXACT:
        lines = [f"{'harness':15} {'context-exact':>24} {'main seqs':>9} {'Δlp':>7}"]
        for name, r in EXACT.items():
            exact = f"{r['share']:.1%} ({r['exact']}/{r['sampled']})"
            lines.append(f"{name:15} {exact:>24} {r['main_sequences']:>9} {r['logprob_gap']:7.0e}")
        show_table(request.config, "context-exact sampled tokens per harness (bwrap, proxy mode):", lines)


@pytest.fixture(scope="module")
def shell_engine(tmp_path_factory):
    """One scripted tiny engine for every CLI harness here (the script is the same; each `polar-mitm rollout` still
    starts its own gateway and sandboxes): an engine start per harness was half of each test's time."""
    root = tmp_path_factory.mktemp("shell-engine")
    script = root / "policy.json"
    script.write_text(json.dumps(SCRIPT))
    with engine_processes.engine_running(
        model="tiny", log=root / "engine.log", extra_args=["--script", str(script)]
    ) as url:
        yield url


@pytest.mark.parametrize(
    "harness",
    ["sdk:openai_chat", *(pytest.param(name, marks=pytest.mark.slow) for name in NPM_PRESETS + OWN_INSTALLS)],
    ids=["sdk", *NPM_PRESETS, *OWN_INSTALLS],
)
def test_a_real_harness_in_bwrap_finishes_and_stays_context_exact(
    harness, tmp_path: Path, tiny_engine, request
):
    if harness in NPM_PRESETS and shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the npm CLIs need it")
    if harness in OWN_INSTALLS:
        get_harness(harness).executable()  # installed by scripts/setup-<name>.sh, or this fails
    if harness.startswith("sdk:"):  # its own engine, started by the rollout (the SDK agent's script differs)
        script = tmp_path / "policy.json"
        script.write_text(json.dumps(policy(harness)))
        engine = ["--script", str(script)]
    else:
        engine = ["--engine", request.getfixturevalue("shell_engine")]
    tasks = tmp_path / "tasks.jsonl"
    line = {"task_id": "hello", "prompt": "Write hello into out.txt", "eval": "grep -qx hello out.txt"}
    tasks.write_text(json.dumps(line) + "\n")
    [row] = rollout_cli(tasks, harness, tmp_path, "-g", "1", "-c", "1", *engine, "--sandbox", "bwrap")
    log = next((tmp_path / "run" / "logs").glob("*.log")).read_text(errors="replace")[-3000:]
    assert (row["status"], row["reward"]) == ("ok", 1.0), f"{row}\n--- harness log ---\n{log}"
    rows = [r for r in read_all(tmp_path / "flows").to_pylist() if r["session_id"] == row["session_id"]]
    rows.sort(key=lambda r: r["seq"])
    if harness in PROXY_SESSION_IN_BWRAP:  # the session's every property (tests/harness/test_harnesses.py)
        context = f"{row}\n--- harness log ---\n{log}"
        EXACT[harness] = check_session(rows, harness, "proxy", tiny_engine, task="hello", context=context)
        return
    if harness == "aider":  # no tools: it writes the file out in its whole-file edit format, then applies it
        assert rows and all(r["completion_ids"] and r["tools_json"] == "[]" for r in rows)
    else:
        main = [r for r in rows if r["tools_json"] != "[]"]
        assert len(main) >= len(COMMANDS) + 1 and all(r["completion_ids"] for r in main)
    result = fidelity(rows, tiny_engine)
    assert result["exact"] == result["sampled"] > 0, result
    EXACT[harness] = result


HARBOR_TASK = Path(__file__).resolve().parents[2] / "examples" / "harbor_tasks" / "count-error-lines"
HARBOR_COMMANDS = [
    """awk '$2 == "ERROR"' /app/app.log | wc -l > /app/error_count.txt""",
    "cat /app/error_count.txt",
]


@pytest.mark.parametrize("harness", ["sdk:openai_chat", pytest.param("pi", marks=pytest.mark.slow)])
def test_a_harbor_task_through_a_real_harness_is_graded_by_its_verifier(harness, tmp_path: Path, tiny_engine):
    """A Harbor task (`polar-mitm tasks harbor`) solved by a real harness in its sandbox (the workspace at the
    task's /app), graded by the task's own verifier after the agent; every sampled token context-exact."""
    if harness == "pi" and shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the npm CLIs need it")
    from polar_mitm.tasks.harbor import ConvertOptions, convert

    tasks = tmp_path / "harbor.jsonl"
    convert([HARBOR_TASK], tasks, ConvertOptions())
    turns = shell_script(HARBOR_COMMANDS, FINAL) if harness == "pi" else None
    if turns is None:
        calls = [
            {"text": f"Running `{c}`.", "tool_call": {"name": "shell", "arguments": {"command": c}}}
            for c in HARBOR_COMMANDS
        ]
        turns = {"turns": [*calls, FINAL]}
    script = tmp_path / "policy.json"
    script.write_text(json.dumps(turns))
    [row] = rollout_cli(tasks, harness, tmp_path, "-g", "1", "-c", "1", "--script", str(script))
    log = next((tmp_path / "run" / "logs").glob("*.log")).read_text(errors="replace")[-3000:]
    assert (row["status"], row["reward"]) == ("ok", 1.0), f"{row}\n--- harness log ---\n{log}"
    rows = [r for r in read_all(tmp_path / "flows").to_pylist() if r["session_id"] == row["session_id"]]
    result = fidelity(rows, tiny_engine)
    assert result["exact"] == result["sampled"] > 0, result
