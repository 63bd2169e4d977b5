"""Every command block of README.md is run by a test (issue 38).

Each ```bash block of the README has an HTML comment on the line before it: `<!-- run by: tests/FILE.py::test_name
-->` names the tests that run its commands (each file must define that function), or `<!-- not run: needs a GPU
-->` says why nothing here can (a GPU, SGLang, a model's weights). Either way every `polar-mitm SUBCOMMAND` a block
uses must be a command of the CLI, every flag it passes one that command takes, every `--set polar_…` a gateway
option and every `scripts/…`, `examples/…` path a file of the checkout — so a renamed flag, command or example
breaks this file, not a new user's first hour.

The blocks that name a test of this file are run here as written, each as one `bash -e` script in a temporary
folder, with the checkout's `.venv/bin` and `node_modules/.bin` on PATH (and `examples/` where the README's
relative paths expect it): the quick-start (a real Pi CLI through `polar-mitm gateway` and SmolLM2, inside a
private loopback-only network namespace where the machine allows one, so its fixed ports 8080/8081 meet no other
test and nothing reaches the internet; the gateway in the background, stopped with SIGINT), the hand-run
rollout → merge → grpo, one loop iteration from `examples/configs/cpu-loop.yaml`, and the config-file commands.
Also: every example config loads into its command, and every relative link of the README and docs/ resolves.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIGS = ROOT / "examples" / "configs"
BIN = Path(sys.executable).parent
RUN_BY = re.compile(r"^<!-- run by: (?P<what>.+?) -->$")
NOT_RUN = re.compile(r"^<!-- not run: (?P<why>.+?) -->$")
TEST_NAME = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


@dataclass(frozen=True)
class Block:
    """One ```bash block of the README: where it starts, its text, and the comment line before it."""

    line: int
    text: str
    comment: str

    @property
    def tests(self) -> list[tuple[str, str]]:
        """The tests its `run by:` comment names, as (file, function)."""
        found = RUN_BY.match(self.comment)
        return TEST_NAME.findall(found["what"]) if found else []


def bash_blocks(text: str) -> list[Block]:
    """The README's ```bash blocks, each with the last non-blank line before its fence."""
    lines = text.splitlines()
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].strip() != "```bash":
            index += 1
            continue
        end = next(j for j in range(index + 1, len(lines)) if lines[j].strip() == "```")
        before = next((lines[j].strip() for j in range(index - 1, -1, -1) if lines[j].strip()), "")
        blocks.append(Block(index + 1, "\n".join(lines[index + 1 : end]), before))
        index = end + 1
    return blocks


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a block as word lists: continuation lines joined, comments dropped, split at
    `;`, `&`, `|`, `&&`, `(`, `)`, and the commands inside `$(…)` taken out too."""
    joined = re.sub(r"\\\n", " ", text)
    commands: list[list[str]] = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        current: list[str] = []
        for word in lexer:
            if set(word) <= set(";&|()<>"):
                commands.append(current)
                current = []
                continue
            for inner in re.findall(r"\$\((.*)\)", word):
                commands.extend(shell_commands(inner))
            current.append(word)
        commands.append(current)
    return [command for command in commands if command]


def polar_invocations(text: str) -> list[list[str]]:
    """Each `polar-mitm …` (or `.venv/bin/polar-mitm …`) of a block: the words after the program name."""
    found = []
    for command in shell_commands(text):
        for position, word in enumerate(command):
            if Path(word).name == "polar-mitm":
                found.append([w.strip("[]") for w in command[position + 1 :] if w.strip("[]")])
                break
    return found


def root_command():
    from polar_mitm.cli import app

    return typer.main.get_command(app)


def flags_of(command) -> set[str]:
    """Every flag spelling the command takes (its generated config options included: `get_params` adds them)."""
    params = command.get_params(command.context_class(command, info_name=command.name))
    return {opt for param in params for opt in [*param.opts, *param.secondary_opts] if opt.startswith("-")}


def resolve(root, words: list[str]) -> tuple[object, list[str], str]:
    """The (sub)command the words name, the words after it, and its name as typed; `config show CMD …` checks the
    flags of CMD. KeyError naming the first word that is no command."""
    command, rest, path = root, list(words), []
    while rest and rest[0].startswith("--") and rest[0] in flags_of(root):
        rest.pop(0)  # a global option (`--debug`)
    while hasattr(command, "commands"):  # a group (Typer's own click, so no isinstance)
        if not rest or rest[0] not in command.commands:
            raise KeyError(f"polar-mitm {' '.join([*path, *(rest[:1] or ['(nothing)'])])}")
        path.append(rest[0])
        command = command.commands[rest.pop(0)]
    if path[:2] == ["config", "show"]:
        return resolve(root, rest)
    return command, rest, " ".join(path)


def problems_with(block: Block, root) -> list[str]:
    """What in a block is no command, no flag of its command, no gateway option, or no file of the checkout."""
    from polar_mitm.gateway.options import mitmproxy_options

    gateway_options = {option.name for option in mitmproxy_options()}
    found = []
    for words in polar_invocations(block.text):
        try:
            command, rest, name = resolve(root, words)
        except KeyError as exc:
            found.append(f"{exc.args[0]} is no command")
            continue
        accepted = flags_of(command)
        for word in rest:
            if re.fullmatch(r"-{1,2}[A-Za-z][\w-]*(=.*)?", word) and word.split("=")[0] not in accepted:
                found.append(f"polar-mitm {name}: no flag {word.split('=')[0]}")
    for command in shell_commands(block.text):
        for flag, value in zip(command, command[1:], strict=False):
            option = value.split("=")[0]
            if flag == "--set" and option.startswith("polar_") and option not in gateway_options:
                found.append(f"--set {option}: no gateway option")
        for word in command:  # the checkout's own files a command names (a script, an example, the addon)
            path = word.split("=")[-1]
            if re.match(r"(scripts|examples|addon|benchmarks)/", path) and not (ROOT / path).exists():
                found.append(f"{path}: no such file in the checkout")
    return found


def defines(path: Path, function: str) -> bool:
    """Does the test file define this test function (at module level or in a class)?"""
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function
        for node in ast.walk(tree)
    )


BLOCKS = bash_blocks(README.read_text())


def block_run_by(test_name: str) -> Block:
    """The one README block whose `run by:` comment names this test of this file."""
    [block] = [b for b in BLOCKS if ("tests/test_readme.py", test_name) in b.tests]
    return block


PROXY_VARIABLES = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}


def user_env(**changes: str) -> dict[str, str]:
    """A new user's shell after the quick-start's `export`: the checkout's tools first on PATH, no proxy settings
    of the machine's own, models from this machine's cache (nothing in these runs may reach a registry)."""
    from polar_mitm.engine.model_zoo import cache_root

    env = {k: v for k, v in os.environ.items() if k.lower() not in PROXY_VARIABLES}
    path = os.pathsep.join([str(BIN), str(ROOT / "node_modules" / ".bin"), env.get("PATH", "")])
    return {
        **env,
        "PATH": path,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "POLAR_MITM_CACHE": str(cache_root()),
        **changes,
    }


def run_block(block: Block, cwd: Path, env: dict[str, str], *, wrap=None, timeout: float = 540) -> str:
    """The block as a bash script (`bash -e`: the first failing command fails it), in its own process group so
    that a run cut short leaves nothing behind; its stdout."""
    script = cwd / f"readme-block-{block.line}.sh"
    script.write_text(block.text + "\n")
    temporary = (
        cwd / "tmp"
    )  # what the commands leave in $TMPDIR (the engine's log, the harness's HOME) stays here
    temporary.mkdir(exist_ok=True)
    env = {**env, "TMPDIR": str(temporary)}
    argv = ["bash", "-e", str(script)]
    # Files, not pipes: a job the block left in the background (the quick-start's gateway, when a later command
    # failed) would hold a pipe open, and reading it to the end would wait out the whole timeout.
    out_path, err_path = cwd / f"readme-block-{block.line}.out", cwd / f"readme-block-{block.line}.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(
            wrap(argv) if wrap else argv,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the block and whatever it left behind
            proc.wait()
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    if timed_out:
        raise AssertionError(
            f"{block_id(block)} ran past {timeout:.0f}s:\n{stdout[-4000:]}\n{stderr[-4000:]}"
        )
    assert proc.returncode == 0, (
        f"{block_id(block)} exited {proc.returncode}:\n{stdout[-4000:]}\n{stderr[-4000:]}"
    )
    return stdout


def with_examples(tmp_path: Path) -> Path:
    """A user's folder where the README's `examples/…` paths resolve (as in the checkout)."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    return tmp_path


def block_id(block: Block) -> str:
    return f"README.md:{block.line}"


def test_the_readme_has_command_blocks_and_one_is_the_quick_start():
    assert len(BLOCKS) >= 8
    quick_start = block_run_by("test_the_quick_start_works_as_written")  # exactly one block
    assert "polar-mitm gateway" in quick_start.text and "polar-mitm harness run" in quick_start.text


@pytest.mark.parametrize("block", BLOCKS, ids=block_id)
def test_each_block_names_the_test_that_runs_it_or_why_none_can(block):
    assert RUN_BY.match(block.comment) or NOT_RUN.match(block.comment), (
        f"{block_id(block)}: the line before ```bash must be `<!-- run by: tests/FILE.py::test_name -->` "
        f"or `<!-- not run: REASON -->`, not {block.comment!r}"
    )
    if RUN_BY.match(block.comment):
        assert block.tests, f"{block_id(block)}: `run by:` names no tests/FILE.py::test_name"
    for file, function in block.tests:
        assert (ROOT / file).is_file(), f"{block_id(block)}: {file} does not exist"
        assert defines(ROOT / file, function), f"{block_id(block)}: {file} defines no {function}"


@pytest.mark.parametrize("block", BLOCKS, ids=block_id)
def test_each_block_uses_real_subcommands_flags_and_gateway_options(block):
    assert problems_with(block, root_command()) == []


def test_the_checker_finds_a_missing_command_flag_gateway_option_and_file():
    # Why: the check above is only as good as its eye; each kind of mistake must show up.
    block = Block(
        1,
        "polar-mitm merge flows/ --no-such-flag \\\n  -o merged/\n"
        '( eval "$(polar-mitm harness envv pi --session s)" )\n'
        "polar-mitm gateway --set polar_max_tokenz=64   # --comment-flag\n"
        "polar-mitm config show loop --itterations 2\n"
        "polar-mitm loop --config examples/configs/no-such-loop.yaml && bash scripts/demo.sh\n",
        "",
    )
    assert problems_with(block, root_command()) == [
        "polar-mitm merge: no flag --no-such-flag",
        "polar-mitm harness envv is no command",
        "polar-mitm loop: no flag --itterations",
        "--set polar_max_tokenz: no gateway option",
        "examples/configs/no-such-loop.yaml: no such file in the checkout",
    ]


# -- the blocks run here, as written -------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_quick_start_works_as_written(tmp_path):
    if not (ROOT / "node_modules" / ".bin" / "pi").exists():
        pytest.skip("the Pi CLI is not installed: bash scripts/setup.sh (npm) installs it")
    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.harness.netns import try_namespace
    from polar_mitm.storage.records import read_all

    resolve_model("smollm2")  # built out here, once: inside the namespace no registry answers
    block = block_run_by("test_the_quick_start_works_as_written")
    home = tmp_path / "home"  # a private ~/.mitmproxy for the gateway's CA
    home.mkdir()
    namespace, how = try_namespace()
    if namespace is None and not all(ports_free(8080, 8081)):
        pytest.skip(f"{how}, and port 8080 or 8081 is in use")
    try:
        output = run_block(
            block, tmp_path, user_env(HOME=str(home)), wrap=namespace.wrap if namespace else None
        )
    finally:
        if namespace is not None:
            namespace.close()

    assert "proxy mode" in output and "HTTPS_PROXY=http://127.0.0.1:8080" in output  # the printed hook-ups
    rows = read_all(tmp_path / "flows").to_pylist()
    assert rows, output[-4000:]
    assert {(r["session_id"], r["task_id"], r["provider"]) for r in rows} == {
        ("s1", "capital", "openai_responses")
    }
    for row in rows:  # Pi's own ~1.5k-token prompt, SmolLM2's answer with ids and logprobs
        assert row["finish_reason"] in ("stop", "length", "tool_calls"), row["error"]
        assert len(row["prompt_ids"]) > 1000 and 0 < len(row["completion_ids"]) <= 64
        assert len(row["completion_logprobs"]) == len(row["completion_ids"])
        assert all(lp <= 0.0 for lp in row["completion_logprobs"])
    assert list((tmp_path / "flows").glob("records-*.parquet"))  # SIGINT: the journal was compacted
    summary = json.loads((tmp_path / "merged" / "_summary.json").read_text())
    assert summary["sequences"] >= 1 and summary["excluded"] == {}
    assert summary["trainable_tokens"] == sum(len(r["completion_ids"]) for r in rows)
    assert summary["context_exact_tokens"] == summary["context_checked_tokens"] > 0
    assert "_engine.json" in summary["eot_source"]  # merge found the end-of-turn token the gateway recorded
    assert "What is the capital of France?" in output  # `show` decoded the prompt with SmolLM2's tokenizer
    assert "s1" in (tmp_path / "report.html").read_text()


def ports_free(*ports: int) -> list[bool]:
    import socket

    free = []
    for port in ports:
        with socket.socket() as sock:
            free.append(sock.connect_ex(("127.0.0.1", port)) != 0)
    return free


@pytest.mark.slow
def test_the_rollout_block_works_as_written(tmp_path):
    from polar_mitm.storage.records import read_all

    cwd = with_examples(tmp_path)
    output = run_block(block_run_by("test_the_rollout_block_works_as_written"), cwd, user_env())
    rewards = [json.loads(line) for line in (cwd / "rewards.jsonl").read_text().splitlines()]
    assert len(rewards) == 12 and all(0.0 <= r["reward"] <= 1.0 for r in rewards)  # 3 tasks × 4 sessions
    assert {r["session_id"] for r in read_all(cwd / "flows").to_pylist()} == {
        r["session_id"] for r in rewards
    }
    summary = json.loads((cwd / "merged" / "_summary.json").read_text())
    assert summary["rewarded_sessions"] == 12 and summary["unrewarded_sessions"] == 0
    assert (cwd / "runs" / "it1" / "model.safetensors").exists(), output[-4000:]


@pytest.mark.slow
def test_the_loop_block_works_as_written(tmp_path):
    cwd = with_examples(tmp_path)
    run_block(block_run_by("test_the_loop_block_works_as_written"), cwd, user_env())
    events = [json.loads(line) for line in (cwd / "loop.jsonl").read_text().splitlines()]
    assert all({"event", "elapsed_s"} <= set(event) for event in events)  # --log-format json: objects only
    assert [e["event"] for e in events].count("iteration") == 1
    assert events[-1]["event"] == "finished" and events[-1]["iterations"] == 1
    run = cwd / "runs" / "cpu-loop"  # the file's run-dir
    assert (run / "loop.json").exists() and (run / "report.html").exists()


@pytest.mark.slow  # three commands, ~5 s each on 2 cores
def test_the_config_block_works_as_written(tmp_path):
    import yaml

    cwd = with_examples(tmp_path)
    output = run_block(block_run_by("test_the_config_block_works_as_written"), cwd, user_env(), timeout=300)
    loop_part, grpo_part = output.split("data:\n", 1)  # the two --show-config outputs, one after the other
    shown, grpo = yaml.safe_load(loop_part), yaml.safe_load("data:\n" + grpo_part)
    assert shown["iterations"] == 8 and shown["run-dir"] == "runs/cpu-loop"  # the flag over the file
    saved = yaml.safe_load((cwd / "my-loop.yaml").read_text())
    assert (
        saved["iterations"] == 8
        and saved["lora"] is True
        and saved["tasks"] == "examples/cpu_tasks/tasks.jsonl"
    )
    assert grpo["data"] == ["merged"] and grpo["model"] == "tiny"


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_is_read_by_its_command(config):
    """`NAME-COMMAND.yaml` loads into `polar-mitm COMMAND --config` with every key an option, and `--show-config`
    gives back each value the file sets."""
    import yaml
    from typer.testing import CliRunner

    from polar_mitm.cli import app

    command = config.stem.rsplit("-", 1)[-1]
    assert command in ("rollout", "loop", "grpo"), f"{config.name}: name it NAME-rollout|loop|grpo.yaml"
    shown = CliRunner().invoke(app, [command, "--config", str(config), "--show-config"])
    assert shown.exit_code == 0, shown.output
    resolved = yaml.safe_load(shown.stdout)
    for key, value in yaml.safe_load(config.read_text()).items():
        expected = [str(Path(v)) for v in value] if key == "data" else value
        assert resolved[key] == expected, key


# -- links ---------------------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces as `-` (code blocks'
    `#` comments are no headings)."""
    found, in_code = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif line.startswith("#") and not in_code:
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_reaches_its_file_and_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(target)
    assert broken == [], f"{page.name}: {broken}"
