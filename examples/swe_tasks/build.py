"""Regenerate the offline SWE instance set from the inflection 0.5.1 sdist (PyPI), deterministically.

    .venv/bin/python examples/swe_tasks/build.py        # downloads the sdist with pip, checks its sha256

What it writes here:
    inflection.bundle      a git bundle: one root commit per instance (the sdist's files with that instance's bug),
                           branch = instance id; commits have fixed authors and dates, so their ids never change
    instances.jsonl        SWE-bench format: instance_id, repo, base_commit, problem_statement, patch (gold),
                           test_patch (a regression test added to the project's test file), FAIL_TO_PASS and
                           PASS_TO_PASS (JSON strings, as SWE-bench stores them), version, …
    wrong_patches.jsonl    per instance a plausible fix that is wrong (the tests use it: reward must be 0.0)
    LICENSE.inflection     the project's MIT license

FAIL_TO_PASS and PASS_TO_PASS come from running the project's own suite (plus the regression test) with pytest -rA
and swebench's `parse_log_pytest`: before the gold patch vs after it. Each bug must break at least one of the
project's own tests, the gold patch must fix every failing test and break none.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # run from a checkout without installing

from polar_mitm.tasks.swe_grading import swebench_harness  # noqa: E402

PROJECT, VERSION, REPO = "inflection", "0.5.1", "jpvanhala/inflection"
SDIST_SHA256 = "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417"
SOURCE, TESTS = "inflection/__init__.py", "test_inflection.py"
# Generated or build-only files of the sdist stay out of the repository.
SKIP = ("PKG-INFO", "inflection.egg-info", "__pycache__")
GIT_ENV = {
    "GIT_AUTHOR_NAME": "inflection sdist",
    "GIT_AUTHOR_EMAIL": "sdist@example.invalid",
    "GIT_COMMITTER_NAME": "inflection sdist",
    "GIT_COMMITTER_EMAIL": "sdist@example.invalid",
    "GIT_AUTHOR_DATE": "2020-08-27T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2020-08-27T00:00:00+00:00",
    "GIT_CONFIG_NOSYSTEM": "1",
    "HOME": "/nonexistent",
}


@dataclass(frozen=True)
class Bug:
    """An injected bug: `fixed` → `buggy` in the source (the gold patch reverts it), a regression test, a wrong fix."""

    name: str
    fixed: str
    buggy: str
    problem: str
    regression: str
    wrong: str  # replaces `buggy` in the wrong patch


BUGS = (
    Bug(
        "ordinal-teens",
        "    if number % 100 in (11, 12, 13):",
        "    if number % 10 in (11, 12, 13):",
        "ordinalize() gives the wrong suffix for 11, 12 and 13\n\n`inflection.ordinalize(11)` returns `'11st'`, "
        "`ordinalize(12)` returns `'12nd'` and `ordinalize(113)` returns `'113rd'`. Numbers whose last two digits "
        "are 11, 12 or 13 always take 'th' in English (11th, 12th, 113th, -1012th). `ordinal()` has the same "
        "problem.",
        "def test_ordinal_teens_take_th():\n"
        "    numbers = (11, 12, 13, 111, 1012, -113)\n"
        "    assert [inflection.ordinalize(n) for n in numbers] == [\n"
        "        '11th', '12th', '13th', '111th', '1012th', '-113th']\n",
        "    if number in (11, 12, 13):",
    ),
    Bug(
        "underscore-acronym",
        "    word = re.sub(r\"([A-Z]+)([A-Z][a-z])\", r'\\1_\\2', word)",
        "    word = re.sub(r\"([A-Z]+)([A-Z][a-z])\", r'\\1\\2', word)",
        "underscore() glues an acronym to the next word\n\n`inflection.underscore('SSLError')` returns "
        "`'sslerror'` and `underscore('HTMLTidyGenerator')` returns `'htmltidy_generator'`. The acronym should be "
        "its own word: `'ssl_error'`, `'html_tidy_generator'`. This also breaks `tableize('HTMLPage')`.",
        "def test_underscore_splits_an_acronym_from_the_next_word():\n"
        "    assert inflection.underscore('SSLError') == 'ssl_error'\n"
        "    assert inflection.underscore('XMLHttpRequest') == 'xml_http_request'\n",
        "    word = re.sub(r\"([A-Z])([A-Z])\", r'\\1_\\2', word)",
    ),
    Bug(
        "parameterize-trailing-separator",
        "        string = re.sub(r\"(?i)^{sep}|{sep}$\".format(sep=re_sep), '', string)",
        "        string = re.sub(r\"(?i)^{sep}\".format(sep=re_sep), '', string)",
        "parameterize() leaves a separator at the end\n\n`inflection.parameterize('Donald E. Knuth')` works, but "
        "`parameterize('Hello, World!')` returns `'hello-world-'` and `parameterize('Hello, World!', '_')` returns "
        "`'hello_world_'`. Like the leading one, a trailing separator should be removed, whatever the separator.",
        "def test_parameterize_strips_a_trailing_separator():\n"
        "    assert inflection.parameterize('Hello, World!') == 'hello-world'\n"
        "    assert inflection.parameterize('Hello, World!', '_') == 'hello_world'\n",
        "        string = re.sub(r\"(?i)^{sep}\".format(sep=re_sep), '', string).rstrip('-')",
    ),
    Bug(
        "pluralize-sh",
        "    (r\"(?i)(x|ch|ss|sh)$\", r'\\1es'),",
        "    (r\"(?i)(x|ch|ss)$\", r'\\1es'),",
        "pluralize() of words ending in 'sh' only appends 's'\n\n`inflection.pluralize('wish')` returns `'wishs'`, "
        "`pluralize('Crash')` returns `'Crashs'`. Like words ending in 'ch' or 'ss', they should take 'es': "
        "`'wishes'`, `'Crashes'`. `tableize('Dish')` is wrong for the same reason.",
        "def test_pluralize_words_ending_in_sh():\n"
        "    words = ('brush', 'dish', 'Crash')\n"
        "    assert [inflection.pluralize(w) for w in words] == ['brushes', 'dishes', 'Crashes']\n",
        "    (r\"(?i)(x|ch|ss|s)$\", r'\\1es'),",
    ),
    Bug(
        "transliterate-accents",
        "    normalized = unicodedata.normalize('NFKD', string)",
        "    normalized = unicodedata.normalize('NFC', string)",
        "transliterate() drops accented letters instead of replacing them\n\n`inflection.transliterate('älämölö')` "
        "returns `'lml'`; the documented result is `'alamolo'`. Because `parameterize()` transliterates first, "
        "`parameterize('Malmö')` gives `'malm'` instead of `'malmo'`.",
        "def test_transliterate_keeps_the_base_letter():\n"
        "    assert inflection.transliterate('Crème brûlée') == 'Creme brulee'\n",
        "    normalized = unicodedata.normalize('NFKC', string)",
    ),
    Bug(
        "camelize-underscore",
        '        return re.sub(r"(?:^|_)(.)", lambda m: m.group(1).upper(), string)',
        '        return re.sub(r"(?:^|_)([a-z])", lambda m: m.group(1).upper(), string)',
        "camelize() keeps underscores before capitals and digits\n\n`inflection.camelize('Camel_Case')` returns "
        "`'Camel_Case'`, `camelize('user_ID')` returns `'User_ID'` and `camelize('version_2_beta')` returns "
        "`'Version_2Beta'`. Every underscore should go: `'CamelCase'`, `'UserID'`, `'Version2Beta'`.",
        "def test_camelize_removes_every_underscore():\n"
        "    assert inflection.camelize('user_ID') == 'UserID'\n"
        "    assert inflection.camelize('version_2_beta') == 'Version2Beta'\n",
        '        return re.sub(r"(?:^|_)([a-zA-Z])", lambda m: m.group(1).upper(), string)',
    ),
)


def git(*args: str, cwd: Path, index: Path | None = None, stdin: str | None = None) -> str:
    """git with fixed identities and dates (the commit ids must not depend on who builds or when)."""
    env = {**os.environ, **GIT_ENV}
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    done = subprocess.run(["git", *args], cwd=cwd, env=env, input=stdin, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr}")
    return done.stdout


def fetch_sdist(tmp: Path) -> Path:
    """Download the sdist with pip and check it is the expected file; the extracted source directory."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"{PROJECT}=={VERSION}",
            "-d",
            str(tmp),
        ],
        check=True,
    )
    archive = tmp / f"{PROJECT}-{VERSION}.tar.gz"
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{archive.name}: sha256 {digest}, expected {SDIST_SHA256}")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    return tmp / f"{PROJECT}-{VERSION}"


def pristine_tree(sdist: Path, dest: Path) -> None:
    """The sdist's files, without its generated metadata."""
    shutil.copytree(sdist, dest, ignore=shutil.ignore_patterns(*SKIP))


def replace_once(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path.name}: expected exactly one {old!r}")
    path.write_text(text.replace(old, new))


def run_suite(work: Path) -> dict[str, str]:
    """The project's tests with pytest -rA, parsed by swebench's parse_log_pytest: test id → status."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "--tb=no", "-p", "no:cacheprovider", TESTS],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    return swebench_harness().log_parsers.PARSER_REGISTRY["parse_log_pytest"](done.stdout, None)


def diff(repo: Path, work: Path, index: Path) -> str:
    """The work tree's changes against the instance's commit, as a patch `git apply` takes."""
    git("--work-tree", str(work), "add", "-A", cwd=repo, index=index)
    return git("--work-tree", str(work), "diff", "--cached", "HEAD", cwd=repo, index=index)


def build_instance(bug: Bug, sdist: Path, repo: Path, tmp: Path) -> tuple[dict, dict]:
    """Commit the buggy tree as a root commit; derive the patches and the test lists. (instance, wrong patch)."""
    instance_id = f"{PROJECT}__{bug.name}"
    work, index = tmp / bug.name, tmp / f"{bug.name}.index"
    pristine_tree(sdist, work)
    replace_once(work / SOURCE, bug.fixed, bug.buggy)
    git("--work-tree", str(work), "add", "-A", cwd=repo, index=index)
    tree = git("write-tree", cwd=repo, index=index).strip()
    commit = git("commit-tree", tree, "-m", f"{PROJECT} {VERSION}", cwd=repo).strip()
    git("update-ref", f"refs/heads/{instance_id}", commit, cwd=repo)
    git("symbolic-ref", "HEAD", f"refs/heads/{instance_id}", cwd=repo)

    with open(work / TESTS, "a") as tests:
        tests.write("\n\n" + bug.regression)
    test_patch = diff(repo, work, index)
    before = run_suite(work)
    replace_once(work / SOURCE, bug.buggy, bug.fixed)
    after = run_suite(work)
    replace_once(work / SOURCE, bug.fixed, bug.wrong)
    shutil.copy(sdist / TESTS, work / TESTS)
    wrong_patch = diff(repo, work, index)
    replace_once(work / SOURCE, bug.wrong, bug.fixed)
    gold_patch = diff(repo, work, index)

    fail_to_pass = sorted(t for t, s in before.items() if s != "PASSED" and after.get(t) == "PASSED")
    pass_to_pass = sorted(t for t, s in before.items() if s == "PASSED" and after.get(t) == "PASSED")
    check_lists(instance_id, before, after, fail_to_pass)
    instance = {
        "instance_id": instance_id,
        "repo": REPO,
        "base_commit": commit,
        "version": VERSION,
        "problem_statement": bug.problem,
        "hints_text": "",
        "created_at": GIT_ENV["GIT_AUTHOR_DATE"],
        "environment_setup_commit": commit,
        "patch": gold_patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(fail_to_pass),
        "PASS_TO_PASS": json.dumps(pass_to_pass),
    }
    return instance, {"instance_id": instance_id, "patch": wrong_patch}


def check_lists(
    instance_id: str, before: dict[str, str], after: dict[str, str], fail_to_pass: list[str]
) -> None:
    """The instance is sound: its bug breaks the project's own tests, the gold patch fixes all and breaks none."""
    own = [t for t in fail_to_pass if not t.endswith(REGRESSION_TESTS)]
    if not own:
        raise SystemExit(f"{instance_id}: the bug breaks none of the project's own tests")
    not_passing = sorted(t for t, s in after.items() if s != "PASSED")
    if not_passing or set(after) != set(before):
        raise SystemExit(f"{instance_id}: with the gold patch {not_passing} do not pass")


REGRESSION_TESTS = tuple("::" + b.regression.split("(")[0].removeprefix("def ") for b in BUGS)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        sdist = fetch_sdist(tmp / "sdist")
        repo = tmp / "repo.git"
        git("init", "-q", "--bare", str(repo), cwd=tmp)
        instances, wrong = zip(*(build_instance(bug, sdist, repo, tmp) for bug in BUGS), strict=True)
        git("symbolic-ref", "HEAD", f"refs/heads/{instances[0]['instance_id']}", cwd=repo)
        bundle = HERE / f"{PROJECT}.bundle"
        bundle.unlink(missing_ok=True)
        git("-c", "pack.threads=1", "bundle", "create", "-q", str(bundle), "--all", cwd=repo)
        (HERE / "instances.jsonl").write_text("".join(json.dumps(i) + "\n" for i in instances))
        (HERE / "wrong_patches.jsonl").write_text("".join(json.dumps(w) + "\n" for w in wrong))
        shutil.copy(sdist / "LICENSE", HERE / "LICENSE.inflection")
    for instance in instances:
        print(
            f"{instance['instance_id']}: FAIL_TO_PASS {len(json.loads(instance['FAIL_TO_PASS']))}, "
            f"PASS_TO_PASS {len(json.loads(instance['PASS_TO_PASS']))}"
        )


if __name__ == "__main__":
    main()
