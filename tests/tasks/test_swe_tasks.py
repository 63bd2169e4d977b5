"""SWE-bench-format instances as rollout tasks, on the offline set (examples/swe_tasks: inflection 0.5.1 + 6 bugs).

Everything is real: git clones the bundle and hides the later history, INIT builds each task's venv (uv), the
project's own pytest suite runs, swebench parses and grades its log; the harness tests run the real Codex CLI
through the real gateway against the tiny engine (scripted, then unscripted). Hostile instances and workspaces
(hardening item 2): test_patch paths that leave the repository, symlinks out of the workspace, a changed grading
spec or venv — grading deletes nothing outside the workspace and grades with nothing the agent changed.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.gateway import processes as gateway_processes
from polar_mitm.harness import get_harness
from polar_mitm.harness.policy import shell_script
from polar_mitm.rollout.harness_spec import GatewayEndpoints, HarnessSpec
from polar_mitm.rollout.runner import Rollout, RolloutConfig, run_shell
from polar_mitm.storage.records import read_all
from polar_mitm.tasks.swe import InstanceError, SweOptions, load_instances, write_tasks
from polar_mitm.tasks.swe_grading import GradingSpec, grade, suite_argv
from polar_mitm.tasks.task_file import Task, load_tasks

SET = Path(__file__).resolve().parents[2] / "examples" / "swe_tasks"
INSTANCES = [json.loads(line) for line in (SET / "instances.jsonl").read_text().splitlines()]
WRONG = {
    w["instance_id"]: w["patch"]
    for w in map(json.loads, (SET / "wrong_patches.jsonl").read_text().splitlines())
}
# Harnesses here never reach a model: a closed port stands in for the gateway.
NO_GATEWAY = GatewayEndpoints("http://127.0.0.1:9")


@pytest.fixture(scope="module")
def swe_file(tmp_path_factory) -> Path:
    """`polar-mitm tasks swe` on the offline set: task file + grading specs + one venv root for the module."""
    root = tmp_path_factory.mktemp("swe")
    result = CliRunner().invoke(
        app,
        [
            "tasks",
            "swe",
            str(SET / "instances.jsonl"),
            "-o",
            str(root / "tasks.jsonl"),
            "--repos",
            str(SET),
            "--run-timeout",
            "240",
            "--eval-timeout",
            "120",
        ],
    )
    assert result.exit_code == 0, result.output
    return root / "tasks.jsonl"


@pytest.fixture(scope="module")
def swe_tasks(swe_file) -> dict[str, Task]:
    return {t.task_id: t for t in load_tasks(swe_file)}  # tasks.py's validation passes


def one_task_file(swe_file: Path, task_id: str, path: Path) -> Path:
    """The task file with one of its tasks."""
    lines = [line for line in swe_file.read_text().splitlines() if json.loads(line)["task_id"] == task_id]
    path.write_text(lines[0] + "\n")
    return path


def rollout_cli(tasks: Path, harness: str, tmp_path: Path, *extra: str) -> list[dict]:
    """`polar-mitm rollout` as a user runs it; the rewards it wrote."""
    rewards = tmp_path / "rewards.jsonl"
    result = CliRunner().invoke(
        app,
        [
            "rollout",
            str(tasks),
            "--harness",
            harness,
            "--out",
            str(tmp_path / "flows"),
            "--rewards",
            str(rewards),
            "--work-dir",
            str(tmp_path / "run"),
            *extra,
        ],
    )
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in rewards.read_text().splitlines()]


def patches_dir(root: Path) -> Path:
    """Gold and wrong patches as files the `cmd:` harness applies ($SWE_PATCHES/{gold,wrong}/TASK.diff)."""
    for kind in ("gold", "wrong"):
        (root / kind).mkdir(parents=True)
        for instance in INSTANCES:
            patch = instance["patch"] if kind == "gold" else WRONG[instance["instance_id"]]
            (root / kind / f"{instance['instance_id']}.diff").write_text(patch)
    return root


def test_the_offline_set_is_sound():
    assert len(INSTANCES) >= 5
    for instance in load_instances(SET / "instances.jsonl"):
        assert instance.repo == "jpvanhala/inflection" and instance.extra["patch"]
        own = [
            t
            for t in instance.fail_to_pass
            if not t.split("::")[1].startswith(
                (
                    "test_ordinal_teens",
                    "test_underscore_splits",
                    "test_parameterize_strips",
                    "test_pluralize_words",
                    "test_transliterate_",
                    "test_camelize_removes",
                )
            )
        ]
        assert own, f"{instance.instance_id}: breaks none of the project's own tests"
        assert len(instance.fail_to_pass) + len(instance.pass_to_pass) >= 400
    assert (
        "MIT" in (SET / "LICENSE.inflection").read_text()
        or "Permission is hereby granted" in (SET / "LICENSE.inflection").read_text()
    )


@pytest.mark.slow
def test_every_instance_gold_patch_scores_one_no_change_and_wrong_patch_zero(
    swe_file, swe_tasks, tmp_path, monkeypatch
):
    monkeypatch.setenv("SWE_PATCHES", str(patches_dir(tmp_path / "patches")))
    # Session 0 applies the gold patch, 1 changes nothing, 2 applies the wrong fix; no model is called, so the
    # rollout attaches to a closed port instead of starting an engine and a gateway. Unconfined: the "agent" reads
    # the patches from the host ($SWE_PATCHES); graded in a sandbox: test_swe_harnesses.py and the codex test below.
    harness = (
        'cmd:if [ {index} = 0 ]; then git apply "$SWE_PATCHES/gold/$POLAR_TASK.diff"; '
        'elif [ {index} = 2 ]; then git apply "$SWE_PATCHES/wrong/$POLAR_TASK.diff"; fi'
    )
    rows = rollout_cli(
        swe_file,
        harness,
        tmp_path,
        "-g",
        "3",
        "-c",
        "2",
        "--gateway-url",
        "http://127.0.0.1:9",
        "--sandbox",
        "none",
    )
    got = {(r["task_id"], r["sample_index"]): (r["status"], r["reward"]) for r in rows}
    expected = {(t, i): ("ok", 1.0 if i == 0 else 0.0) for t in swe_tasks for i in range(3)}
    assert got == expected, {
        k: r["eval_output"][-600:] for r in rows if got[k := (r["task_id"], r["sample_index"])] != expected[k]
    }
    env_root = Path(spec_of(swe_tasks[INSTANCES[0]["instance_id"]]).env_dir).parent
    assert len([p for p in env_root.iterdir() if p.is_dir()]) == len(swe_tasks)  # one venv per task, reused
    report_timing(rows)


def report_timing(rows: list[dict]) -> None:
    """Seconds per instance (INIT with the venv, evaluation), printed with -s."""
    lines = ["", "offline SWE set: seconds per instance (init max / eval mean over gold, none, wrong)"]
    for task_id in sorted({r["task_id"] for r in rows}):
        mine = [r for r in rows if r["task_id"] == task_id]
        init = max(r["init_seconds"] or 0 for r in mine)
        evaluation = sum(r["eval_seconds"] or 0 for r in mine) / len(mine)
        lines.append(f"  {task_id:45} init {init:5.1f}  eval {evaluation:5.1f}")
    print("\n".join(lines))


async def prepared_workspace(task: Task, path: Path) -> Path:
    """INIT by hand, as the runner does it: clone without a shell, then the task's setup commands."""
    path.mkdir(parents=True)
    subprocess.run(["git", "clone", "-q", "--", task.workspace_git, "."], cwd=path, check=True)
    for command in task.setup:
        code, out = await run_shell(command, path, 120)
        assert code == 0, out
    return path


def spec_of(task: Task) -> GradingSpec:
    return GradingSpec.load(Path(task.meta["swe"]["spec"]))


def test_workspace_holds_only_the_base_commit_and_the_env_is_built_once(swe_tasks, tmp_path):
    task = swe_tasks["inflection__ordinal-teens"]
    first = asyncio.run(prepared_workspace(task, tmp_path / "a"))
    log = subprocess.run(
        ["git", "log", "--all", "--format=%H"], cwd=first, capture_output=True, text=True
    ).stdout
    assert log.split() == [task.meta["swe"]["base_commit"]]  # no later commit, no other instance's tree
    started = time.monotonic()
    asyncio.run(prepared_workspace(task, tmp_path / "b"))
    assert time.monotonic() - started < 30
    env = Path(spec_of(task).env_dir)
    assert (env / "bin" / "python").exists() and (env / ".polar-env-ready").exists()


def test_grading_undoes_edits_to_the_tests_and_fraction_rewards_partial_fixes(swe_tasks, tmp_path):
    task = swe_tasks["inflection__ordinal-teens"]
    instance = next(i for i in INSTANCES if i["instance_id"] == task.task_id)
    spec = spec_of(task)

    # Cheating: every assertion of the test file made true. Grading restores the file: 0.0.
    cheat = asyncio.run(prepared_workspace(task, tmp_path / "cheat"))
    tests = cheat / "test_inflection.py"
    tests.write_text(tests.read_text().replace("    assert ", "    assert True or "))
    assert grade(spec, cheat).reward == 0.0

    # The gold patch plus a broken test file still scores 1.0: the graded tests are the task's, not the agent's.
    gold = asyncio.run(prepared_workspace(task, tmp_path / "gold"))
    subprocess.run(["git", "apply", "-"], cwd=gold, input=instance["patch"], text=True, check=True)
    (gold / "test_inflection.py").write_text("raise SystemExit(1)\n")
    result = grade(spec, gold)
    assert (result.reward, result.resolution) == (1.0, "RESOLVED_FULL")

    # The wrong fix repairs 11-13 but not 111: resolved → 0.0; fraction → the share of FAIL_TO_PASS fixed.
    wrong = asyncio.run(prepared_workspace(task, tmp_path / "wrong"))
    subprocess.run(["git", "apply", "-"], cwd=wrong, input=WRONG[task.task_id], text=True, check=True)
    assert grade(spec, wrong).reward == 0.0
    spec.reward = "fraction"
    partial = grade(spec, wrong)
    assert 0.0 < partial.reward < 1.0
    assert partial.reward == pytest.approx(partial.fixed / len(spec.fail_to_pass))


def test_the_grader_prints_the_reward_last_even_when_grading_fails(swe_tasks, tmp_path):
    task = swe_tasks["inflection__pluralize-sh"]
    empty = tmp_path / "not-a-repo"
    empty.mkdir()
    code, out = asyncio.run(run_shell(task.eval_command, empty, 60))
    assert code == 0 and out.rstrip().splitlines()[-1] == "reward: 0", out


# -- instance files with faults -------------------------------------------------------------------------------------


def write_instances(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("base_commit"), "missing field base_commit"),
        (lambda r: r.update(FAIL_TO_PASS="test_a, test_b"), "field FAIL_TO_PASS must be a list of test ids"),
        (lambda r: r.update(FAIL_TO_PASS="[]"), "field FAIL_TO_PASS is empty"),
        (lambda r: r.update(PASS_TO_PASS=[1, 2]), "field PASS_TO_PASS must be a list of test ids"),
        (lambda r: r.update(base_commit="main; rm -rf /"), "field base_commit must be a hex commit id"),
        (lambda r: r.update(repo="inflection"), "field repo must be OWNER/NAME"),
        (lambda r: r.update(test_patch="just text"), "field test_patch"),
        (lambda r: r.update(problem_statement=""), "field problem_statement must be a non-empty string"),
        (lambda r: r.update(patch=7), "field patch must be a string"),
    ],
)
def test_a_bad_instance_is_named_with_its_line_and_field(tmp_path, change, message):
    rows = [dict(i) for i in INSTANCES[:3]]
    change(rows[1])
    path = write_instances(tmp_path / "bad.jsonl", rows)
    with pytest.raises(InstanceError) as caught:
        load_instances(path)
    text = str(caught.value)
    assert f"{path}:2: instance {rows[1]['instance_id']!r}" in text and message in text, text


def test_the_cli_reports_a_bad_instance_in_one_line_and_writes_no_task_file(tmp_path):
    rows = [dict(i) for i in INSTANCES[:2]]
    rows[1]["instance_id"] = "bad\nid"
    path = write_instances(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "tasks.jsonl"
    result = CliRunner().invoke(app, ["tasks", "swe", str(path), "-o", str(out), "--repos", str(SET)])
    assert result.exit_code == 2 and not out.exists()
    assert "bad.jsonl:2" in result.output and "instance_id cannot contain control" in result.output


def test_options_are_checked_and_other_sources_and_images_are_used(tmp_path):
    instances = load_instances(SET / "instances.jsonl")[:1]
    with pytest.raises(ValueError, match="unknown placeholder"):
        write_tasks(instances, SweOptions(prompt_template="Fix {issue}"), tmp_path / "t.jsonl")
    with pytest.raises(InstanceError, match="no mirror of jpvanhala/inflection"):
        write_tasks(instances, SweOptions(repos=tmp_path), tmp_path / "t.jsonl")
    tasks = write_tasks(
        instances,
        SweOptions(
            image="swebench/sweb.eval.x86_64.{docker_id}:latest",
            prompt_template="{repo}: {problem_statement}",
        ),
        tmp_path / "t.jsonl",
    )
    assert tasks[0]["workspace"]["git"] == "https://github.com/jpvanhala/inflection.git"
    assert tasks[0]["prompt"].startswith("jpvanhala/inflection: ordinalize()")
    spec = GradingSpec.load(Path(tasks[0]["swe"]["spec"]))
    assert spec.image == "swebench/sweb.eval.x86_64.inflection_1776_ordinal-teens:latest"
    load_tasks(tmp_path / "t.jsonl")


def test_parquet_and_json_instance_files_with_list_columns_load(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {**i, "FAIL_TO_PASS": json.loads(i["FAIL_TO_PASS"]), "PASS_TO_PASS": json.loads(i["PASS_TO_PASS"])}
        for i in INSTANCES
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "instances.parquet")
    (tmp_path / "instances.json").write_text(json.dumps(INSTANCES))
    expected = [
        (i.instance_id, i.fail_to_pass, i.pass_to_pass) for i in load_instances(SET / "instances.jsonl")
    ]
    for name in ("instances.parquet", "instances.json"):
        got = [(i.instance_id, i.fail_to_pass, i.pass_to_pass) for i in load_instances(tmp_path / name)]
        assert got == expected, name
    rows[2]["FAIL_TO_PASS"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(
        InstanceError,
        match=r"bad.parquet:row 2: instance 'inflection__parameterize-trailing-sep"
        r"arator': missing field FAIL_TO_PASS",
    ):
        load_instances(tmp_path / "bad.parquet")


def test_tests_run_in_the_instance_image_with_the_workspace_mounted(tmp_path):
    spec = GradingSpec(
        instance_id="a__b-1",
        base_commit="abc1234",
        test_patch=INSTANCES[0]["test_patch"],
        fail_to_pass=["t"],
        pass_to_pass=[],
        image="sweb.eval.x86_64.a_1776_b-1:latest",
        env_dir=str(tmp_path / "env"),
        container_setup="conda activate testbed",
    )
    argv, _ = suite_argv(spec, tmp_path / "ws")
    assert argv[:3] == ["docker", "run", "--rm"] and f"{tmp_path / 'ws'}:/testbed" in argv
    assert argv[-4:] == [
        "sweb.eval.x86_64.a_1776_b-1:latest",
        "bash",
        "-c",
        "export PYTHONSAFEPATH=1 PYTHONDONTWRITEBYTECODE=1 PYTHONNOUSERSITE=1 && conda activate testbed && "
        "python -m pytest -rA --tb=no -p no:cacheprovider -c /dev/null --rootdir . --confcutdir . test_inflection.py",
    ]  # the workspace off sys.path at start, and pytest's configuration search kept inside it (swe_workspace)
    spec.container = "apptainer"
    argv, _ = suite_argv(spec, tmp_path / "ws")
    assert argv[:2] == ["apptainer", "exec"] and str(tmp_path / "env" / "image.sif") in argv


# -- a real harness through the gateway ----------------------------------------------------------------------------


def codex_or_skip() -> None:
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed: the harness CLIs need it")
    try:
        get_harness("codex").executable()
    except Exception as exc:  # noqa: BLE001 — not installed here
        pytest.skip(f"codex CLI not installed: {exc}")


def rollout_through(gateway: gateway_processes.GatewayProcess, task: Task, tmp_path: Path):
    endpoints = GatewayEndpoints(gateway.reverse_url, gateway.proxy_url, gateway.ca_bundle())
    config = RolloutConfig(
        group_size=1, concurrency=1, workspace_root=tmp_path / "ws", log_dir=tmp_path / "logs"
    )
    session = asyncio.run(Rollout([task], HarnessSpec("codex"), endpoints, config).run()).sessions[0]
    rows = [r for r in read_all(gateway.out_dir).to_pylist() if r["session_id"] == session.session_id]
    log = (tmp_path / "logs" / f"{session.session_id}.log").read_text(errors="replace")[-3000:]
    return session, rows, f"{session.status} {session.eval_output[-1500:]}\n--- harness log ---\n{log}"


@pytest.mark.slow
def test_codex_applies_the_gold_patch_with_its_shell_tool_through_the_gateway(
    swe_file, tmp_path, tiny_engine
):
    codex_or_skip()
    task_id = "inflection__pluralize-sh"
    gold = next(i for i in INSTANCES if i["instance_id"] == task_id)["patch"]
    script = tmp_path / "policy.json"
    script.write_text(
        json.dumps(
            shell_script(
                [f"git apply - <<'POLAR_PATCH_EOF'\n{gold}POLAR_PATCH_EOF"],
                "Fixed: words ending in 'sh' take 'es'.",
            )
        )
    )
    # `polar-mitm rollout` starts the scripted tiny engine and the gateway itself; Codex runs in proxy mode.
    tasks = one_task_file(swe_file, task_id, tmp_path / "one.jsonl")
    [row] = rollout_cli(tasks, "codex", tmp_path, "-g", "1", "-c", "1", "--script", str(script))
    records = [r for r in read_all(tmp_path / "flows").to_pylist() if r["session_id"] == row["session_id"]]
    log = next((tmp_path / "run" / "logs").glob("*.log")).read_text(errors="replace")[-3000:]
    context = f"{row}\n--- harness log ---\n{log}"
    assert (row["status"], row["reward"]) == ("ok", 1.0), context
    assert "RESOLVED_FULL" in row["eval_output"]
    calls = [r for r in records if r["finish_reason"] == "tool_calls"]
    assert calls and all(r["task_id"] == task_id and r["completion_ids"] for r in records), context
    assert "git apply - <<'POLAR_PATCH_EOF'" in tiny_engine.tokenizer.decode(calls[0]["completion_ids"])


@pytest.mark.slow
def test_the_unscripted_tiny_model_scores_zero_and_its_run_is_recorded(swe_tasks, tmp_path):
    codex_or_skip()
    task = swe_tasks["inflection__ordinal-teens"]
    # A short answer budget: the untrained model's text is noise, and a long one only costs time.
    with gateway_processes.engine_and_gateway(
        tmp_path / "flows",
        confdir=tmp_path / "conf",
        engine_args=["--threads", "1"],
        engine_log=tmp_path / "engine.log",
        gateway_log=tmp_path / "gateway.log",
        gateway_options={"polar_max_tokens": "48"},
    ) as (_, gateway):
        session, rows, context = rollout_through(gateway, task, tmp_path)
    assert session.status in ("ok", "crashed") and session.reward == 0.0, context
    assert rows and all(r["completion_ids"] for r in rows if r["status_code"] == 200), context


# -- hostile test patches and workspaces: grading touches nothing outside the workspace ----------------------------


def creating(path: str, source: str = "/dev/null") -> str:
    """A test_patch that creates the file `path` (as the diff names it, b/ prefix included)."""
    return f"--- {source}\n+++ {path}\n@@ -0,0 +1,2 @@\n+def test_new():\n+    pass\n"


ESCAPING_PATCHES = [
    (creating("b//etc/polar-victim"), "'/etc/polar-victim' is absolute"),
    (creating("b/../../../polar-victim"), "'../../../polar-victim' has a '..' component"),
    ("--- a/../../x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n", "'../../x.py' has a '..' component"),
    (creating("b/.git/hooks/post-checkout"), "'.git/hooks/post-checkout' is inside .git"),
    (creating("b/tests/a\u0000b.py"), "contains a NUL character"),
]


@pytest.mark.parametrize(("test_patch", "message"), ESCAPING_PATCHES)
def test_an_instance_whose_test_patch_leaves_the_repository_is_refused_by_tasks_swe(
    tmp_path, test_patch, message
):
    rows = [dict(INSTANCES[0]), {**INSTANCES[1], "test_patch": test_patch}]
    path = write_instances(tmp_path / "hostile.jsonl", rows)
    out = tmp_path / "tasks.jsonl"
    result = CliRunner().invoke(app, ["tasks", "swe", str(path), "-o", str(out), "--repos", str(SET)])
    assert result.exit_code == 2 and not out.exists(), result.output
    assert (
        f"hostile.jsonl:2: instance {INSTANCES[1]['instance_id']!r}: field test_patch: path" in result.output
    )
    assert message in result.output, result.output


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def small_workspace(root: Path) -> tuple[Path, str]:
    """A workspace as INIT leaves it: a repository whose base commit holds tests/test_a.py."""
    workspace = root / "ws"
    (workspace / "tests").mkdir(parents=True)
    (workspace / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    git(workspace, "init", "-q")
    git(workspace, "add", ".")
    git(workspace, "commit", "-qm", "base")
    return workspace, git(workspace, "rev-parse", "HEAD")


def grade_with_the_grader(workspace: Path, base_commit: str, test_patch: str, root: Path) -> str:
    """`python -m polar_mitm.tasks.swe_grading grade SPEC SHA256` in the workspace, as the eval command runs it."""
    spec = GradingSpec(
        instance_id="hostile__x-1",
        base_commit=base_commit,
        test_patch=test_patch,
        fail_to_pass=["tests/test_new.py::test_new"],
        pass_to_pass=[],
        env_dir=str(root / "env"),
    )
    digest = spec.save(root / "spec.json")
    done = subprocess.run(
        [sys.executable, "-m", "polar_mitm.tasks.swe_grading", "grade", str(root / "spec.json"), digest],
        cwd=workspace,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.rstrip().splitlines()[-1] == "reward: 0", (
        done.stdout + done.stderr
    )
    return done.stdout


def sentinel(outside: Path, name: str, directory: bool = False) -> Path:
    """A file (or a folder holding one) outside the workspace that grading must leave alone."""
    path = outside / name
    if directory:
        path.mkdir(parents=True)
        (path / "keep.txt").write_text("keep\n")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("keep\n")
    return path


def survived(path: Path) -> bool:
    return (path / "keep.txt" if path.is_dir() else path).read_text() == "keep\n"


@pytest.mark.parametrize("directory", [False, True], ids=["file", "folder"])
@pytest.mark.parametrize("form", ["absolute", "dotdot"])
def test_a_hand_written_spec_naming_paths_outside_the_workspace_deletes_nothing(tmp_path, form, directory):
    workspace, base = small_workspace(tmp_path)
    victim = sentinel(tmp_path / "outside", "victim", directory)
    named = f"b/{victim}" if form == "absolute" else "b/../outside/victim"
    out = grade_with_the_grader(workspace, base, creating(named), tmp_path)
    assert survived(victim), out
    assert "GRADING_ERROR" in out and ("is absolute" in out or "'..'" in out), out


@pytest.mark.parametrize(
    "layout", ["test dir linked out", "parent of a test dir linked out", "base test file's dir linked out"]
)
def test_a_workspace_symlink_out_of_the_workspace_is_never_followed_by_grading(tmp_path, layout):
    workspace, base = small_workspace(tmp_path)
    outside = tmp_path / "outside"
    if layout == "test dir linked out":  # the patch creates tests/victim; the agent made tests/ a link out
        victim, test_patch = sentinel(outside, "victim"), creating("b/tests/victim")
        shutil.rmtree(workspace / "tests")
        (workspace / "tests").symlink_to(outside)
    elif (
        layout == "parent of a test dir linked out"
    ):  # tests/data/victim, with tests/data → outside/ (a folder)
        victim, test_patch = sentinel(outside, "victim", directory=True), creating("b/tests/data/victim")
        (workspace / "tests" / "data").symlink_to(outside)
    else:  # a file of the base commit, its folder a link to a copy outside
        victim = sentinel(outside, "test_a.py")
        test_patch = "--- a/tests/test_a.py\n+++ b/tests/test_a.py\n@@ -1,2 +1,2 @@\n def test_a():\n-    pass\n+    pass  # \n"
        shutil.rmtree(workspace / "tests")
        (workspace / "tests").symlink_to(outside)
    out = grade_with_the_grader(workspace, base, test_patch, tmp_path)
    assert survived(victim), out
    assert "escapes the workspace" in out and "GRADING_ERROR" in out, out


def test_a_test_file_that_is_a_symlink_is_removed_as_a_link_and_its_target_kept(tmp_path):
    workspace, base = small_workspace(tmp_path)
    victim = sentinel(tmp_path / "outside", "victim", directory=True)
    (workspace / "tests" / "test_new.py").symlink_to(victim)
    out = grade_with_the_grader(workspace, base, creating("b/tests/test_new.py"), tmp_path)
    assert survived(victim), out
    new = workspace / "tests" / "test_new.py"
    assert not new.is_symlink() and new.read_text() == "def test_new():\n    pass\n"  # the patch applied
    assert "environment" in out  # then grading stopped: this spec has no venv


def test_a_grading_spec_changed_after_tasks_swe_is_refused(swe_tasks, tmp_path):
    task = swe_tasks["inflection__pluralize-sh"]
    workspace = asyncio.run(prepared_workspace(task, tmp_path / "ws"))
    spec_path = Path(task.meta["swe"]["spec"])
    original = spec_path.read_bytes()
    changed = json.loads(original)
    changed["test_command"] = f"touch {tmp_path / 'PWNED-spec'}; {changed['test_command']}"
    try:
        spec_path.chmod(0o644)  # read-only stops accidents only: the agent is the same user
        spec_path.write_text(json.dumps(changed))
        code, out = asyncio.run(run_shell(task.eval_command, workspace, 120))
    finally:
        spec_path.write_bytes(original)
        spec_path.chmod(0o444)
    assert not (tmp_path / "PWNED-spec").exists(), out
    assert code == 0 and "changed since `polar-mitm tasks swe` wrote it" in out, out
    assert out.rstrip().splitlines()[-1] == "reward: 0"


def test_a_venv_changed_after_init_is_refused_by_grading_and_rebuilt_by_the_next_init(swe_tasks, tmp_path):
    task = swe_tasks["inflection__pluralize-sh"]
    workspace = asyncio.run(prepared_workspace(task, tmp_path / "a"))
    env = Path(spec_of(task).env_dir)
    [site_packages] = env.glob("lib/python*/site-packages")
    # An agent's leftover: code that every later test run in this venv would execute.
    (site_packages / "polar_cheat.pth").write_text(
        f"import pathlib; pathlib.Path({str(tmp_path)!r}, 'PWNED').touch()\n"
    )
    code, out = asyncio.run(run_shell(task.eval_command, workspace, 120))
    assert not (tmp_path / "PWNED").exists(), out
    assert code == 0 and "changed since INIT built it" in out and "GRADING_ERROR" in out, out
    asyncio.run(prepared_workspace(task, tmp_path / "b"))  # the next INIT of the task rebuilds it
    assert not (site_packages / "polar_cheat.pth").exists()
    code, out = asyncio.run(run_shell(task.eval_command, tmp_path / "b", 120))
    assert "RESOLVED_NO" in out and not (tmp_path / "PWNED").exists(), out
