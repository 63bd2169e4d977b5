"""`--config FILE.yaml` and `--show-config` (polar_mitm/config_file.py) on the commands whose options come from
configs: a file's keys are the flags (or the fields), a flag given overrides the file, what `--show-config` prints
reads back to the same options, and a key that is no option is one line naming the file and the likely key.

Each case runs the real command line (`polar_mitm.cli.main`) in this process; `--show-config` runs nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from polar_mitm.user_errors import DEBUG_ENV
from tests.test_user_errors import assert_one_line, run_cli


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "")


def shown(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, *argv, "--show-config")
    assert code == 0, err
    return yaml.safe_load(out)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_file_sets_options_by_flag_or_field_name_and_a_given_flag_overrides_it(capsys, tmp_path):
    config = write(
        tmp_path / "rollout.yaml",
        "max-tokens: 7\ntemperature: 0.25\nengine_url: http://127.0.0.1:1/\nconcurrency: 3\n",
    )
    resolved = shown(capsys, "rollout", "tasks.jsonl", "--config", str(config))
    assert (resolved["max-tokens"], resolved["temperature"], resolved["concurrency"]) == (7, 0.25, 3)
    assert resolved["engine"] == "http://127.0.0.1:1/"  # the field engine_url is the flag --engine
    overridden = shown(capsys, "rollout", "tasks.jsonl", "--config", str(config), "--max-tokens", "9")
    assert (overridden["max-tokens"], overridden["concurrency"]) == (9, 3)


@pytest.mark.parametrize(
    "argv",
    [
        ["rollout", "tasks.jsonl"],
        ["loop", "tasks.jsonl", "--iterations", "3", "--lr-scheduler", "cosine", "--seed", "5"],
        ["grpo", "--data", "merged/", "--learning-rate", "3e-5", "--loss-type", "dapo"],
    ],
    ids=lambda argv: argv[0],
)
def test_what_show_config_prints_reads_back_to_the_same_options(capsys, tmp_path, argv):
    first = shown(capsys, *argv)
    saved = write(tmp_path / "run.yaml", yaml.safe_dump(first))
    again = shown(capsys, argv[0], *[a for a in argv[1:2] if not a.startswith("-")], "--config", str(saved))
    assert again == first
    if argv[0] == "loop":
        assert (first["iterations"], first["seed"]) == (3, 5)


def test_a_key_that_is_no_option_is_one_line_with_the_likely_one(capsys, tmp_path):
    config = write(tmp_path / "loop.yaml", "iterations: 2\nmax_token: 5\n")
    code, _, err = run_cli(capsys, "loop", "tasks.jsonl", "--config", str(config))
    assert_one_line(code, err, f"--config {config}: 'max_token' is no option of `polar-mitm loop`")
    assert "did you mean max-tokens?" in err


@pytest.mark.parametrize(
    ("text", "expected"),
    [("- a\n- b\n", "a mapping of option names to values, not list"), ("a: [1,\n", "--config ")],
    ids=["a-list", "not-yaml"],
)
def test_a_file_that_is_no_mapping_of_options_is_one_line(capsys, tmp_path, text, expected):
    config = write(tmp_path / "bad.yaml", text)
    code, _, err = run_cli(capsys, "grpo", "--data", "merged/", "--config", str(config))
    assert_one_line(code, err, expected)
    assert str(config) in err


def test_config_show_prints_what_the_command_would_run_with(capsys, tmp_path):
    config = write(tmp_path / "loop.yaml", "iterations: 4\nlearning-rate: 0.001\n")
    via_config = shown(capsys, "loop", "tasks.jsonl", "--config", str(config), "-g", "2")
    code, out, err = run_cli(
        capsys, "config", "show", "loop", "tasks.jsonl", "--config", str(config), "-g", "2"
    )
    assert code == 0, err
    assert yaml.safe_load(out) == via_config
    assert (via_config["iterations"], via_config["learning-rate"], via_config["group-size"]) == (4, 1e-3, 2)
    code, _, err = run_cli(capsys, "config", "show", "merge")
    assert_one_line(code, err, "config show merge: one of rollout, loop, grpo, serve-rollouts")


def test_the_rollout_service_takes_a_config_file_too(capsys, tmp_path):
    config = write(tmp_path / "service.yaml", "max-sessions: 3\nport: 8799\nqueue_limit: 9\n")
    resolved = shown(capsys, "serve-rollouts", "--config", str(config), "--port", "8800")
    assert (resolved["max-sessions"], resolved["queue-limit"], resolved["port"]) == (3, 9, 8800)
    bad = write(tmp_path / "bad.yaml", "max-session: 3\n")
    code, _, err = run_cli(capsys, "serve-rollouts", "--config", str(bad))
    assert_one_line(
        code, err, "'max-session' is no option of `polar-mitm serve-rollouts`: did you mean max-sessions?"
    )
