"""A new user's mistakes, each met with one line and exit 2 (issue 38): `polar_mitm.user_errors` and `cli.main`.

Every case is the real command line (`polar_mitm.cli.main`, what the `polar-mitm` script runs) on real input: a
dead port, a folder with nothing in it, a shard cut short, a scripted policy that names another harness's tool.
Most run in this process (the CLI's imports are paid once); one runs the installed `polar-mitm` script, and the
gateway's misspelt option runs the real mitmdump.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm.cli import main
from polar_mitm.processes import ports
from polar_mitm.reconstruct.merge import merge
from polar_mitm.storage.records import read_all
from polar_mitm.storage.run_layout import TRAINING_RESULT_FILE
from polar_mitm.user_errors import DEBUG_ENV
from tests.test_usage_line import start_mitmdump

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_FLOWS = ROOT / "sample_flows"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def merged_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("merged") / "merged"
    merge([str(SAMPLE_FLOWS)], str(out))
    return out


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "")  # `--debug` sets it in this process; restored after each test


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`polar-mitm ARGV` in this process: (exit code, stdout, stderr)."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line(code: int, err: str, expected: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected in lines[0], lines[0]


def cut_short(merged: Path, into: Path) -> Path:
    """A copy of `merged` whose shard lost its footer (a copy killed mid-way)."""
    shutil.copytree(merged, into)
    shard = next(into.glob("merged-*.parquet"))
    shard.write_bytes(shard.read_bytes()[:300])
    return into


def test_each_mistake_of_the_first_hour_is_one_line_and_exit_2(capsys, tmp_path, merged_dir):
    dead = f"http://127.0.0.1:{ports.free_port()}"
    nothing, empty = tmp_path / "nope", tmp_path / "empty"
    empty.mkdir()
    corrupt = cut_short(merged_dir, tmp_path / "corrupt")
    tasks = ROOT / "examples" / "cpu_tasks" / "tasks.jsonl"
    policy = ROOT / "examples" / "cpu_tasks" / "policy.json"
    trained = tmp_path / "trained"  # what a finished `polar-mitm grpo` leaves, beside its checkpoint
    trained.mkdir()
    (trained / TRAINING_RESULT_FILE).write_text("{}")
    cases = [
        (["chat", "--engine", dead], f"--engine {dead}: nothing answers"),
        (["grpo", "--data", str(nothing), "-o", str(tmp_path / "g")], f"no merged shards at {nothing}"),
        (["grpo", "--data", str(corrupt), "-o", str(tmp_path / "g")], "not a readable merged shard"),
        (
            ["grpo", "--data", str(merged_dir), "-o", str(trained)],
            f"--output-dir {trained} already holds a finished training; pass --overwrite",
        ),
        (["stats", str(corrupt)], "not a readable merged shard"),
        (["show", "any-id", "--data", str(corrupt)], "not a readable merged shard"),
        (["sft", "--data", str(empty), "-o", str(tmp_path / "s")], f"no merged shards under {empty}"),
        (["plot", str(nothing)], f"no metrics at {nothing}"),
        (["records", str(nothing)], f"{nothing}: no such record folder"),
        (["report", str(nothing)], f"{nothing} is not a directory"),
        (["serve", "--model", str(nothing)], "not a checkpoint directory (no config.json)"),
        (
            ["rollout", str(tasks), "--harness", "claude-code", "--script", str(policy)],
            "it calls shell, a shell tool claude-code does not offer (it offers Bash)",
        ),
        (["rollout", str(tasks), "--script", str(nothing)], f"script {nothing}:"),
        (["rollout", str(tasks), "--max-tokens", "0"], "--max-tokens 0: must be at least 1"),
        (
            ["rollout", str(tasks), "--gateway-url", dead, "--temperature", "0.5"],
            "--set polar_temperature=T), not here",
        ),
        (
            ["merge", str(SAMPLE_FLOWS), "-o", str(merged_dir)],
            "already holds merged shards; pass --overwrite",
        ),
    ]
    for argv, expected in cases:
        code, _, err = run_cli(capsys, *argv)
        assert_one_line(code, err, expected)


def test_debug_shows_the_traceback_of_a_user_error(capsys, tmp_path):
    from polar_mitm.storage.location import InputNotFound

    with pytest.raises(InputNotFound, match="no metrics at"):
        main(["--debug", "plot", str(tmp_path / "nope")])


def test_the_installed_command_says_a_mistake_in_one_line(tmp_path):
    """The `polar-mitm` script itself (its entry point is `main`): one line on stderr, exit 2."""
    done = subprocess.run(
        [str(BIN / "polar-mitm"), "plot", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120
    )
    assert_one_line(done.returncode, done.stderr, "no metrics at")


def test_help_and_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("polar-mitm ")
    for argv in (["-h"], ["merge", "-h"], ["tasks", "-h"]):
        code, out, _ = run_cli(capsys, *argv)
        assert code == 0 and "Usage: polar-mitm" in out, argv


def test_stats_and_report_read_only_their_inputs(capsys, tmp_path, merged_dir):
    """`stats` leaves a PNG and `report` an HTML file in the merged folder; neither is read back as a shard."""
    folder = tmp_path / "merged"
    shutil.copytree(merged_dir, folder)
    for argv in (
        ["stats", str(folder)],
        ["report", str(folder)],
        ["report", str(folder)],
        ["stats", str(folder)],
    ):
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, (argv, out, err)
    assert (folder / "stats.png").is_file() and (folder / "report.html").is_file()


def test_merge_names_reward_rows_of_sessions_it_never_saw(capsys, tmp_path):
    sessions = sorted(set(read_all(SAMPLE_FLOWS / "records")["session_id"].to_pylist()))
    rewards = tmp_path / "rewards.jsonl"
    rows = [{"session_id": s, "reward": 1.0} for s in [sessions[0], "ghost-a", "ghost-b"]]
    rewards.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = run_cli(
        capsys, "merge", str(SAMPLE_FLOWS), "-o", str(tmp_path / "m"), "--rewards", str(rewards)
    )
    assert code == 0
    assert "warning: 2 reward row(s) name sessions in no record (ghost-a, ghost-b)" in " ".join(out.split())
    code, _, err = run_cli(capsys, "merge", str(SAMPLE_FLOWS), "-o", str(tmp_path / "m"), "--overwrite")
    assert code == 0, err


def test_a_misspelt_gateway_option_stops_the_gateway(tmp_path, engine_url):
    """`--set polar-out=X` (a dash) was deferred by mitmproxy for ever: records went to the default folder."""
    proc = start_mitmdump(tmp_path, engine_url, ports.free_port(), "--set", "polar-out=elsewhere")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, output
    assert "unknown option polar-out: did you mean polar_out?" in output
