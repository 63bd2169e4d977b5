"""Hardening issue 36, item 9: no `cmd:` placeholder runs code, in any context bash's grammar offers.

Generative: contexts are built from bash itself (`compgen -b` builtins, `compgen -k` keywords) and its compound
forms, a placeholder goes into each argument position in each quoting, and the hostile values try to run
`touch MARK`. For every generated template, either it is refused when parsed (TemplateError), or the substituted
command, run by a real `bash -c` in its own folder, creates no MARK.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from polar_mitm.rollout import shell_template

HOSTILE = [
    "a[$(touch MARK)]",  # runs wherever bash takes the value as a name or arithmetic
    "$(touch MARK)",
    "`touch MARK`",
    "x;touch MARK",
    "-v a[$(touch MARK)]",  # an option that takes a name, if the value is read as options
    "-va[$(touch MARK)]",  # the same as one option word (`printf -vNAME`)
]
VALUES = [{"task": value, "prompt": value} for value in HOSTILE] + [
    {"task": "-v", "prompt": "a[$(touch MARK)]"}  # two placeholders that make `[ -v NAME ]` together
]
# How the placeholder stands in its word: bare, in each quote, as an assignment's value, as a key, as a subscript.
FORMS = [
    "{task}",
    "'{task}'",
    '"{task}"',
    "$'{task}'",
    "x{task}",
    "v={task}",
    "[{task}]=1",
    "v[{task}]",
    "v[{task}]=1",
    "{task}=1",
]
# Argument positions of a command C, with the options that take names or code in some builtin.
SLOTS = [
    "<C> <F>",
    "<C> <F> x",
    "<C> x <F>",
    "<C> -- <F>",
    "<C> -v <F>",
    "<C> -n <F>",
    "<C> -i <F>",
    "<C> -a <F>",
    "<C> -p <F>",
    "<C> -W <F>",
    "<C> -x <F>",
    "<C> -R <F>",
    "<C> %s <F>",
    "<C> <F> = x",
    "<C> <F> {prompt}",
]
# Compound forms a command X can stand in (braces of the shell are doubled, as in a template).
WRAPPERS = [
    "f() {{ <X>; }}; f",
    "function g {{ <X>; }}; g",
    "( <X> )",
    "{{ <X>; }}",
    "if <X>; then :; fi",
    "if :; then <X>; fi",
    "if false; then :; elif <X>; then :; else :; fi",
    "while <X>; do break; done",
    "until <X>; do break; done",
    "for i in 1; do <X>; done",
    "for (( i = 0; i < 1; i++ )); do <X>; done",
    "case x in x) <X>;; esac",
    "select i in 1; do <X>; break; done",
    "<X> | cat",
    "true && <X>",
    "false || <X>",
    "coproc <X>",
    "coproc c {{ <X>; }}",
    "time <X>",
    "time -p <X>",
    "! <X>",
    'echo "$(<X>)"',
    "echo $(<X>)",
    "cat <(<X>)",
    "<X> > /dev/null 2>&1",
    "v=1 <X>",
    "<X> &",
    "eval '<X>'",
    'eval "<X>"',
    "trap '<X>' EXIT",
    "command <X>",
    "builtin <X>",
    "exec <X>",
]
# Contexts where bash evaluates or re-reads a word (F: the placeholder in one of FORMS).
EXPRESSIONS = [
    "[[ <F> ]]",
    "[[ <F> -eq 1 ]]",
    "[[ -v <F> ]]",
    "[[ x == <F> ]]",
    "(( <F> ))",
    "(( x = <F> ))",
    "echo $(( <F> ))",
    "echo $[ <F> ]",
    "for (( i = <F>; i < 1; i++ )); do :; done",
    "b=( <F> )",
    "b=([<F>]=1)",
    "b+=([<F>]=1)",
    "declare -a b=([<F>]=1)",
    "declare -A b=([<F>]=1)",
    "local -a b=([<F>]=1)",
    "f() {{ local <F>=1; }}; f",
    "f() {{ local -n r=<F>; }}; f",
    "f() {{ declare <F>; }}; f",
    "declare -n r; r=<F>; echo $r",
    "declare -i n; n=<F>",
    "x=<F>; (( x ))",
    "x=<F>; echo $(( x ))",
    "x=<F>; [[ x -eq 1 ]]",
    "x=<F>; echo ${{y[x]}}",
    "export x=<F>; let x",
    "x[<F>]=1",
    "echo ${{x[<F>]}}",
    "echo ${{x:<F>}}",
    "echo ${{!<F>}}",
    "echo ${{x:-<F>}}",
    'echo "${{x:-<F>}}"',
    "case <F> in a) ;; esac",
    "case a in <F>) ;; esac",
    "case a in (<F>) ;; esac",
    "for i in <F>; do :; done",
    "select i in <F>; do break; done",
    "cat <<< <F>",
    "read x <<< <F>; (( x ))",
    "cat < <(echo <F>)",
    "echo x > <F>",
    "echo x 2>&1 <F>",
    "read x 2>&1 <F>",
    "read x 2> /dev/null <F>",
    "echo x >& <F>",
    "printf -v v <F>",
    "printf -v<F> x",
    "printf <F> x",
    "printf '%s' <F>",
    "printf '%d' <F>",
    "printf '%*s' <F> x",
    "printf '%(%F)T' <F>",
    "test <F>",
    "test -n <F>",
    "test <F> -eq 1",
    "test ! -v <F>",
    "[ <F> ]",
    "[ <F> = x ]",
    "[ -n <F> ]",
    "[ <F> <F> ]",
    "[ <F> {prompt} ]",
    "test <F> {prompt} = x",
    "[ ! <F> ]",
    "[ x = y -o <F> ]",
    "[ $PWD = <F> ]",
    "[ <F> -eq 1 ] && echo",
    "[ <F> = x ] || printf '%s\\n' <F>",
    "compgen -W <F>",
    "trap <F> EXIT",
    "eval <F>",
    "source <F>",
    ". <F>",
    "let <F>",
    "<F>",
    "<F> x",
    "$<F>",
    "${{<F>}}",
    "x=1 <F>",
    "alias e=echo; e <F>",
    "shopt -s expand_aliases; alias e=read; e <F>",
    'f() {{ read "$1"; }}; f <F>',
    'echo() {{ read "$1"; }}; echo <F>',
    "mapfile -t -C <F> -c 1 v < /etc/hostname",
    "env x=<F> true",
    "echo $(echo <F>)",
    "read $(echo <F>)",
    'read "$(echo <F>)"',
    "declare $(echo <F>)=1",
    "cd <F>; pwd",
    "exit <F>",
    "f() {{ return <F>; }}; f",
]
BASH_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}


def compgen(flag: str) -> list[str]:
    done = subprocess.run(
        ["bash", "-c", f"compgen {flag}"], capture_output=True, text=True, timeout=30, check=True
    )
    return sorted(set(done.stdout.split()))


def name(command: str) -> str:
    """A command name as template text (`{` is written `{{`)."""
    return command.replace("{", "{{").replace("}", "}}")


def close(command: str) -> str:
    return " ]" if command == "[" else ""


def generated_templates() -> list[str]:
    commands = compgen("-b") + compgen("-k")
    simple = []
    for command in commands:
        for slot in SLOTS:  # every argument position, the placeholder bare
            simple.append(slot.replace("<C>", name(command)).replace("<F>", "{task}") + close(command))
        for slot in SLOTS[:3]:  # the plain positions in every form
            for form in FORMS:
                simple.append(slot.replace("<C>", name(command)).replace("<F>", form) + close(command))
    wrapped = []
    for wrapper in WRAPPERS:
        for command in commands:
            for slot in ("<C> <F>", "<C> -v <F>"):
                inner = slot.replace("<C>", name(command)).replace("<F>", "{task}") + close(command)
                wrapped.append(wrapper.replace("<X>", inner))
    expressions = [expression.replace("<F>", form) for expression in EXPRESSIONS for form in FORMS]
    expressions += [
        wrapper.replace("<X>", expression.replace("<F>", "{task}"))
        for wrapper in WRAPPERS[:6]
        for expression in EXPRESSIONS
    ]
    return list(dict.fromkeys(simple + wrapped + expressions))


def accepted_scripts(module, templates: list[str]) -> tuple[dict[str, str], int]:
    """For each template `module` accepts, one bash script running it with every hostile value in turn (each in a
    subshell, with the values also in $POLAR_TASK/$POLAR_PROMPT as a harness has them); and how many it refused."""
    scripts, refused = {}, 0
    for template in templates:
        try:
            parsed = module.ShellTemplate(template)
        except module.TemplateError:
            refused += 1
            continue
        runs = []
        for values in VALUES:
            env = "; ".join(
                f"export POLAR_{key.upper()}={shlex.quote(value)}" for key, value in values.items()
            )
            runs.append(f"(\n{env}\n{parsed.render(values)}\n)")
        scripts[template] = "\n".join(runs)
    return scripts, refused


def scripts_that_run_code(scripts: dict[str, str], root: Path) -> list[str]:
    """Run each script by `bash -c` in its own folder (stdin /dev/null, `timeout 5`, a bare environment), in two
    batches at once; the keys of the scripts after which a MARK exists."""
    keys = list(scripts)
    batches = [keys[0::2], keys[1::2]]
    drivers = []
    for b, batch in enumerate(batches):
        lines = []
        for k, key in enumerate(batch):
            folder = root / f"b{b}c{k}"
            folder.mkdir(parents=True)
            lines.append(
                f"cd {shlex.quote(str(folder))} && timeout 5 bash -c {shlex.quote(scripts[key])} "
                "</dev/null >/dev/null 2>&1"
            )
        driver = root / f"batch{b}.sh"
        driver.write_text("\n".join(lines) + "\n")
        drivers.append(driver)

    def run(driver: Path) -> None:
        subprocess.run(["bash", str(driver)], cwd=root, env={**BASH_ENV, "HOME": str(root)}, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, drivers))
    time.sleep(0.2)  # a background `X &` or coproc finishes
    found = []
    for mark in root.rglob("MARK"):
        folder = mark.relative_to(root).parts[0]
        if not (folder.startswith("b") and "c" in folder):
            found.append(f"MARK outside any case folder: {mark}")
            continue
        b, k = folder[1:].split("c")
        found.append(batches[int(b)][int(k)])
    return sorted(set(found))


def test_bash_itself_names_only_builtins_and_keywords_the_module_classifies():
    # Why: a builtin the module does not know would be taken for a program, whose arguments are data.
    assert set(compgen("-b")) <= set(shell_template.BUILTINS), set(compgen("-b")) - set(
        shell_template.BUILTINS
    )
    known_keywords = shell_template.PREFIX_KEYWORDS | set(shell_template.KEYWORDS) | {"function", "coproc"}
    assert set(compgen("-k")) <= known_keywords, set(compgen("-k")) - known_keywords


def test_no_generated_template_runs_the_hostile_value(tmp_path):
    templates = generated_templates()
    scripts, refused = accepted_scripts(shell_template, templates)
    ran = scripts_that_run_code(scripts, tmp_path)
    print(f"{len(templates)} templates: {refused} refused, {len(scripts)} accepted and run")
    assert ran == [], f"{len(ran)} accepted templates ran the value, e.g. {ran[:8]}"
    assert len(scripts) > 500  # not vacuous: many templates are accepted and run


def test_the_runner_sees_code_run(tmp_path):
    # Why: the property above is only as good as the runner's eye; an evaluating command must show up.
    ran = scripts_that_run_code(
        {"evaluates": "(( a[$(touch MARK)] ))", "literal": "echo 'a[$(touch MARK)]'"}, tmp_path
    )
    assert ran == ["evaluates"]


REPOSITORY_TEMPLATES = [  # the `cmd:` templates of README.md, recipes/, examples/ and tests/ stay accepted
    "for turn in 1 2; do curl -sf {base_url}/v1/chat/completions -H 'content-type: application/json' "
    '-d \'{{"model": "m", "max_tokens": 4, "messages": [{{"role": "user", '
    '"content": "session {session} turn \'$turn\'"}}]}}\' > /dev/null || exit 1; done; echo hello > out.txt',
    "curl -sf {base_url}/v1/chat/completions -H 'content-type: application/json' "
    '-d \'{{"model": "m", "max_tokens": 2, "messages": [{{"role": "user", "content": "hi"}}]}}\' '
    "> /dev/null && sleep 0",
    "if [ {index} -ge 2 ]; then sleep 60; fi; echo hello > out.txt",
    "if [ {task} = slow ]; then echo $$ > pid; sleep 120; fi; echo hello > out.txt",
    'if [ {index} = 0 ]; then echo "$POLAR_TASK.diff"; elif [ {index} = 2 ]; then echo wrong; fi',
    "echo hello > {workspace}/out.txt",
    f"{sys.executable} -c 'import sys; print(sys.argv)' {{prompt}} {{index}}",
    "printf '%s\\n' {task} {session} > out.txt",
    'echo "{prompt}" > out.txt',
    "echo '{prompt}' > out.txt",
    "echo $'{prompt}' > out.txt",
    'echo "said: {prompt} (task {task})" > out.txt',
    'echo "$(echo {prompt})" > out.txt',
    "echo ${{NOT_SET:-{prompt}}} > out.txt",
    "[ {task} = x ] || printf '%s\\n' {task}",
    'echo "$((1 + 2))" > /dev/null; printf "%s\\n" "{task}"',
    "(( n = 2 )); [[ $n -eq 2 ]] && printf '%s\\n' {task}",
    "export X={task}; printf '%s\\n' \"$X\"",
    "arr=(1 2); a[0]=3; printf '%s\\n' \"${{arr[1]}}\" > /dev/null; printf '%s\\n' {task}",
    "( cd {workspace} && printf '%s\\n' {prompt} ) 2>&1 | tee log",
    "X={task} env | grep -c X= > /dev/null; cat <<< {prompt} > out.txt",
]


@pytest.mark.parametrize("template", REPOSITORY_TEMPLATES)
def test_the_templates_in_use_are_accepted_and_pass_values_literally(tmp_path, template):
    parsed = shell_template.ShellTemplate(template)
    values = {name: HOSTILE[0] for name in shell_template.PLACEHOLDERS} | {"workspace": str(tmp_path)}
    rendered = parsed.render(values)
    subprocess.run(
        ["bash", "-c", rendered], cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, timeout=10
    )
    assert not (tmp_path / "MARK").exists()


def test_a_long_template_parses_in_linear_time():
    # Why: the scanner runs on every template; no input may make it spin.
    started = time.monotonic()
    for template in (
        "echo " + "abc " * 20000 + "{task}",
        "echo " + "{task} " * 3000,
        "a" + "[" * 20000 + "{task}",
        "echo " + "$(" * 2000 + "echo {task}" + ")" * 2000,
    ):
        try:
            shell_template.ShellTemplate(template)
        except shell_template.TemplateError:
            pass
    assert time.monotonic() - started < 10
