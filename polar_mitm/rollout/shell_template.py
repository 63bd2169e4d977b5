"""`cmd:` harness templates: each placeholder becomes exactly one shell word that holds its value literally.

Task ids and prompts come from task files, so a value must never be parsed as shell syntax. Bare placeholders are
shell-quoted. A placeholder inside '…', "…" or $'…' is spliced: the quote is closed, the quoted value inserted, the
quote reopened (`"task {task}"` → `"task "'a;b'""`), which bash joins into one word. Where no quoting can keep a value
literal — a comment (a newline in the value ends it), backticks (a backtick in the value ends them), a here-document
body, `${…}` inside double quotes (single quotes are literal there), right after a backslash or a `$` — the template
is rejected when it is parsed, before any session starts; the same values are in the environment for those places.

Quoting is not enough where bash *evaluates* a word's value: a task id `a[$(touch F)]` runs `touch F` as an array
subscript wherever bash takes it as a variable name or arithmetic, however it is quoted. Rather than list those
places (every builtin option that takes a name, every compound form), the positions a placeholder may take are an
allowlist; everything else is refused:

- an argument of a simple command whose name is a literal word: a program, or a builtin classified safe in BUILTINS
  (`printf` after a literal format and without -v; `test`/`[` in the one-, two- and three-argument forms without
  -v/-R; `export NAME=…`);
- the value of a plain `NAME=` assignment word (not `NAME[…]=`, not inside `NAME=(…)`), in a template with no
  arithmetic, `[[ … ]]`, subscript, `let`, `declare -i`/`-n`, `eval`, `source` or `trap`, which evaluate variables'
  values again;
- a redirection's target (`> {workspace}/out.txt`, `<<< {prompt}`), but not of `>&`/`<&` (bash may expand it
  twice).

Inside `$(…)` the same holds at every level: the substitution's word must itself be in an allowed position. A value
that reaches a variable (an assignment, a here-string, any `read` in the template) in a template that also evaluates
variables (the list above) is refused too. A second shell (`bash -c {prompt}`, `ssh`) parses a value again: no
template quoting can prevent that.
"""

from __future__ import annotations

import re
import shlex
import string
from collections.abc import Mapping
from dataclasses import dataclass, field

PLACEHOLDERS = ("prompt", "workspace", "session", "task", "index", "base_url", "proxy_url", "ca_bundle")
QUOTES = ("'", '"', "$'")  # the quoting contexts a value can be spliced into
WORD_BREAKS = frozenset(" \t\n;&|()<>")  # after one of these a `#` starts a comment
COMMAND_BREAKS = frozenset(";&|\n")  # they end a simple command
CODE = ("sh", "(", "$(")  # contexts where bash reads commands (words, separators, a command name)
EVALUATED = {  # contexts whose text bash evaluates: arithmetic (array subscripts in values run commands), [[ ]]
    "$((": "inside $((...)) arithmetic",
    "((": "inside ((...)) arithmetic",
    "$[": "inside $[...] arithmetic",
    "[": "inside an array subscript NAME[...] (arithmetic)",
    "[[": "inside a [[ ... ]] conditional",
}
SAFE = "safe"
CHECKED = "checked"  # safe in some forms only: see QuotingScanner._builtin_problem
# Every builtin of bash 5.2 (`compgen -b`), classified once. A name not here is a program: its arguments are data.
BUILTINS = {
    # Safe: the arguments are text, paths or numbers read as plain numbers (no arithmetic, no names, no code).
    ":": SAFE,  # expands its arguments and does nothing
    "true": SAFE,
    "false": SAFE,
    "echo": SAFE,  # prints them
    "cd": SAFE,  # a directory (and -L/-P/-e/-@)
    "pwd": SAFE,  # options only
    "pushd": SAFE,  # a directory or +N/-N, read as a plain number
    "popd": SAFE,
    "dirs": SAFE,
    "exit": SAFE,  # these five read a plain number (legal_number), not arithmetic
    "return": SAFE,
    "break": SAFE,
    "continue": SAFE,
    "shift": SAFE,
    "printf": CHECKED,  # -v NAME takes a name, the format's options too: only after a literal format, without -v
    "test": CHECKED,  # -v/-R take names, and operators in values reshape the expression: fixed small forms only
    "[": CHECKED,
    "export": CHECKED,  # only `export NAME=…` (no options): a plain assignment; `export NAME` takes a name
    # Refused: they take variable names (whose subscripts are evaluated), evaluate, run code or define things.
    ".": "it runs a file as shell code",
    "source": "it runs a file as shell code",
    "eval": "it runs its arguments as shell code",
    "trap": "it runs its argument as shell code on a signal",
    "alias": "it defines commands",
    "unalias": "it changes what commands are",
    "bind": "it binds keys to shell code",
    "builtin": "it runs its first argument as a builtin",
    "command": "it runs its first argument as a command",
    "exec": "it runs its first argument as a command",
    "caller": "it takes a frame number; not needed in a harness",
    "compgen": "it expands its -W word list and takes variable names",
    "complete": "it defines completions that run code",
    "compopt": "it changes completions",
    "declare": "it takes variable names; with -i or -n the value is evaluated",
    "typeset": "it takes variable names; with -i or -n the value is evaluated",
    "local": "it takes variable names; with -i or -n the value is evaluated",
    "readonly": "it takes variable names; with -i or -n the value is evaluated",
    "disown": "it takes job specifications",
    "bg": "it takes job specifications",
    "fg": "it takes job specifications",
    "jobs": "its -x runs a command",
    "kill": "it signals the processes its arguments name",
    "wait": "its -p takes a variable name",
    "enable": "it loads and disables builtins",
    "fc": "it runs commands from the history",
    "history": "it edits the history that fc runs",
    "getopts": "it takes a variable name",
    "hash": "it remaps command names to files",
    "help": "not needed in a harness",
    "let": "it evaluates arithmetic",
    "logout": "not needed in a harness",
    "mapfile": "it takes an array name, and -C runs code",
    "readarray": "it takes an array name, and -C runs code",
    "read": "it takes variable names, and evaluates their subscripts",
    "set": "it changes shell options (a value such as -x is one)",
    "shopt": "it changes shell options",
    "suspend": "not needed in a harness",
    "times": "it takes no arguments",
    "type": "not needed in a harness",
    "ulimit": "it changes resource limits",
    "umask": "it changes the file mode mask",
    "unset": "it takes variable names, and evaluates their subscripts",
}
PREFIX_KEYWORDS = frozenset({"if", "then", "else", "elif", "do", "while", "until", "!", "{", "time"})
KEYWORDS = {  # `compgen -k` that are not prefixes of a command: a placeholder is never safe in their words
    "case": "a `case` word or pattern",
    "esac": "a word after `esac`",
    "for": "a `for` loop's words (the loop variable takes the value)",
    "select": "a `select` menu's words (the variable takes the value)",
    "in": "a loop's word list",
    "fi": "a word after `fi`",
    "done": "a word after `done`",
    "}": "a word after `}`",
    "[[": "inside a [[ ... ]] conditional",
    "]]": "a word after `]]`",
}
DECLARATIONS = frozenset({"declare", "typeset", "local", "readonly"})
# Commands and contexts that evaluate variables' values again (recursively, as arithmetic or code): a template with
# one of them may not assign a placeholder to a variable, since that variable may be what they evaluate.
VALUE_EVALUATORS = frozenset({"let", "eval", "source", ".", "trap"})
TEST_UNARY = frozenset("-a -b -c -d -e -f -g -h -k -p -r -s -t -u -w -x -G -L -N -O -S -n -z -o".split())
TEST_BINARY = frozenset("= == != < > -eq -ne -lt -le -gt -ge -nt -ot -ef".split())
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\[[^\]]*\])?\+?=")
PLAIN_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
LITERAL_NAME = re.compile(r"[A-Za-z0-9_./~+@%:,=\[-]+")  # a command name that is what it says
FUNCTION_HEADER = re.compile(r"[^\s()]+\(\)")
REDIRECT_OPERATOR = re.compile(r"(?:[0-9]+|\{[A-Za-z_][A-Za-z0-9_]*\})?(?:<|>|>>|<<<|<>|>\||&>|&>>|>&|<&)")
# `${NAME op word}` where the word is plain text (defaults, patterns, replacements), not a subscript or an offset.
BRACE_WORD = re.compile(
    r"(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-])(?:\[[^\]]*\])?"
    r"(?::?[-=+?]|##?|%%?|/[/#%]?|\^\^?|,,?)"
)
BRACE_EVALUATES = re.compile(r"!|[^}]*?(?:\[|:(?![-=+?]))")  # indirection, a subscript or an offset
FIELD_MARK = "\ue000"  # stands for a substituted placeholder in the text a context has seen
_FORMATTER = string.Formatter()


class TemplateError(ValueError):
    """A `cmd:` template that cannot be substituted safely (or names an unknown placeholder)."""


def env_name(placeholder: str) -> str:
    """The environment variable that carries a placeholder's value (`prompt` → `POLAR_PROMPT`)."""
    return f"POLAR_{placeholder.upper()}"


def _evaluated_error(name: str, problem: str) -> TemplateError:
    return TemplateError(
        f"{{{name}}} is {problem}, where bash evaluates the value whatever its quoting (a value such as "
        f"a[$(cmd)] runs cmd; ${env_name(name)} is no safer there); use it as plain text instead, "
        f"e.g. [ {{{name}}} = x ] or an argument of a program"
    )


def _refused_error(name: str, problem: str) -> TemplateError:
    return TemplateError(
        f"{{{name}}} is {problem}: a placeholder may only be an argument of a command named literally (a program, "
        f"or a builtin that neither takes names nor runs code), the value of a plain NAME=…, or a redirection "
        f'target; pass "${env_name(name)}" there as a quoted argument of a program instead'
    )


@dataclass(frozen=True)
class Field:
    """One placeholder of a template and the quotes it sits inside ("" when bare)."""

    name: str
    conversion: str | None
    format_spec: str
    quote: str


@dataclass
class Word:
    raw: str
    plain: str  # without quotes and backslashes
    redirect: bool  # a redirection operator or its target, not an argument


@dataclass
class Context:
    """One open context of the scanner and the template text seen inside it (nested contexts' text included)."""

    kind: str
    text: str = ""
    opener: str = ""  # "(" contexts: the word before the parenthesis (`b=` for `b=(…)`, `<` for `<(…)`)
    words: list[Word] = field(
        default_factory=list
    )  # CODE contexts: the finished words of the current command
    word_start: int = 0  # CODE contexts: where the current word starts in `text`
    redirect_in_word: bool = False  # an unquoted `<` or `>` was seen in the current word
    target_next: bool = False  # the last word was a bare redirection operator: this word is its target
    duplicating: bool = False  # the current word's redirection is `>&`/`<&`, or is its target
    pending_tests: list[tuple[str, int]] = field(default_factory=list)  # (placeholder, word index) in test/[

    @property
    def word(self) -> str:
        return self.text[self.word_start :]


class QuotingScanner:
    """Follows bash's quoting through a template's literal text, so each placeholder knows its context.

    The stack holds the open contexts: "sh" (unquoted), "(" and "$(" (subshell / command substitution: quoting
    starts afresh inside), "${" (parameter expansion), the quotes, "`", "#" (a comment, until the newline) and the
    evaluated ones of EVALUATED. CODE contexts also split their text into words and simple commands, so that a
    placeholder knows which command it is an argument of.
    """

    def __init__(self) -> None:
        self.stack: list[Context] = [Context("sh")]
        self.escaped = False  # the last character was an unescaped backslash
        self.prev = ""  # the last character seen (a placeholder counts as a word character)
        self.heredoc_pending = False  # a `<<` was seen: its body starts at the next newline
        self.in_heredoc = False
        # A `case` pattern's unmatched `)` can end a "$(…)" early in this scanner's eyes; inside double quotes that
        # would misplace every later placeholder, so those are refused instead.
        self.lost_in_case = False
        self.value_evaluator = (
            ""  # the first thing seen that evaluates variables' values again (see VALUE_EVALUATORS)
        )
        self.assigned: list[
            str
        ] = []  # placeholders assigned to a variable (NAME={…}) or fed to one (<<< {…})
        self.fields: list[str] = []  # every placeholder substituted
        self.reader = ""  # the first command that reads data into variables (`read`, x=$(…), …)
        self.functions: set[str] = set()  # functions the template defines
        self.called: list[tuple[str, str]] = []  # (placeholder, command) for placeholders given to a command
        self.aliases = False  # the template runs `alias`

    @property
    def kinds(self) -> list[str]:
        return [context.kind for context in self.stack]

    def feed(self, text: str) -> None:
        """Advance over literal template text."""
        i = 0
        while i < len(text):
            i += self._step(text, i)

    def after_field(self) -> None:
        """A placeholder was substituted here: one word, so no comment can start right after it."""
        self.prev, self.escaped = "a", False
        self.stack[-1].text += FIELD_MARK

    def finish(self) -> None:
        """The end of the template: the last commands end, and checks that need the whole template run."""
        while len(self.stack) > 1:
            self._pop()
        self._end_command(self.stack[0], final=True)
        # The value may reach a variable that the evaluator evaluates: directly, or through a pipe or a file.
        if self.value_evaluator and (self.assigned or (self.reader and self.fields)):
            if self.assigned:
                name, how = self.assigned[0], "assigned to a variable in a template that"
            else:
                name, how = (
                    self.fields[0],
                    f"in a template that reads data into variables ({self.reader}) and",
                )
            raise _evaluated_error(
                name,
                f"{how} also has {self.value_evaluator} (there, and after declare -i or -n, arithmetic, [[ ]], "
                "subscripts, let, eval, source or trap, bash evaluates variables' values again)",
            )
        for name, command in self.called:
            if command in self.functions:
                raise _refused_error(name, f"an argument of `{command}`, a function the template defines")
            if self.aliases:
                raise _refused_error(name, f"an argument of `{command}` in a template that defines aliases")

    def _push(self, kind: str) -> None:
        opener = self.stack[-1].word if kind == "(" else ""
        self.stack.append(Context(kind, opener=opener))
        if kind in EVALUATED and not self.value_evaluator:
            self.value_evaluator = EVALUATED[kind].removeprefix("inside ")

    def _pop(self) -> None:
        inner = self.stack.pop()
        if inner.kind in CODE:
            self._end_command(inner, final=True)
        if inner.kind == "${" and BRACE_EVALUATES.match(inner.text) and not self.value_evaluator:
            self.value_evaluator = "a ${...} subscript, offset or indirection"
        self.stack[-1].text += inner.text

    def _step(self, text: str, i: int) -> int:
        """Consume the character at i (and a lookahead where bash does); returns how many were consumed."""
        depth, owner, was_escaped = len(self.stack) - 1, self.stack[-1], self.escaped
        char, top = text[i], owner.kind
        consumed = 1
        if self.escaped:
            self.escaped = False
        elif top == "#":
            if char == "\n":
                self._pop()
        elif top == "'":
            if char == "'":
                self._pop()
        elif top in ("$'", "`", '"') and char == "\\":
            self.escaped = True
        elif top in ("$'", "`"):
            if char == top[-1]:
                self._pop()
        elif top == '"':
            consumed = self._double_quoted(text, i)
        else:
            consumed = self._unquoted(text, i)
        # The text goes to the context it was read in; a closing character (its context gone) to the one outside.
        owner_open = len(self.stack) > depth and self.stack[depth] is owner
        (owner if owner_open else self.stack[-1]).text += text[i : i + consumed]
        current = self.stack[-1]
        if current.kind in CODE and not was_escaped and (current is owner or top == "#"):
            self._split(current, text[i : i + consumed])
        self.prev = text[i + consumed - 1]
        return consumed

    def _double_quoted(self, text: str, i: int) -> int:
        char = text[i]
        if char == '"':
            self._pop()
        elif char == "`":
            self._push("`")
        elif char == "$":
            return self._dollar(text, i, ("(", "{"))
        return 1

    def _dollar(self, text: str, i: int, openers: tuple[str, ...]) -> int:
        """A `$` that may open `$((`, `$[` or one of `openers` (`$(`, `${`, `$'`)."""
        if text.startswith("$((", i):
            self._push("$((")
            return 3
        nxt = text[i + 1 : i + 2]
        if nxt == "[" or nxt in openers:
            self._push("$" + nxt)
            return 2
        return 1

    def _unquoted(self, text: str, i: int) -> int:
        char, nxt, context = text[i], text[i + 1 : i + 2], self.stack[-1]
        top = context.kind
        if char == "\\":
            self.escaped = True
        elif char == "$":
            return self._dollar(text, i, ("(", "{", "'"))
        elif char in ("'", '"', "`"):
            self._push(char)
        elif char in "()[]":
            return self._bracket(text, i)
        elif char == "}" and top == "${":
            self._pop()
        elif char == "#" and top != "${" and (self.prev == "" or self.prev in WORD_BREAKS):
            self._push("#")
        elif char == "c" and _word_at(text, i, "case") and (self.prev == "" or self.prev in WORD_BREAKS):
            self.lost_in_case = self.lost_in_case or '"' in self.kinds
        elif char == "<" and nxt == "<" and text[i + 2 : i + 3] != "<" and self.prev != "<" and top in CODE:
            self.heredoc_pending = True
            context.redirect_in_word = True
            return 2
        elif char in "<>" and nxt != "(" and top in CODE:
            context.redirect_in_word = True
        elif char == "&" and nxt == ">" and top in CODE:  # `&>`: a redirection, not a background `&`
            context.redirect_in_word = True
            return 2
        elif char == "\n" and self.heredoc_pending:
            self.in_heredoc = True  # conservative: the rest of the template is treated as the body
        return 1

    def _bracket(self, text: str, i: int) -> int:
        """Parentheses and brackets: subshells, `((…))`, `[[ … ]]` and array subscripts open and close here."""
        char, nxt, context = text[i], text[i + 1 : i + 2], self.stack[-1]
        top = context.kind
        at_word_start = top in CODE and not context.word
        if char == "(" and nxt == "(" and at_word_start:
            self._push("((")
            return 2
        if char == "(":
            self._push("(")
        elif char == ")" and nxt == ")" and top in ("((", "$(("):
            self._pop()
            return 2
        elif char == ")" and top in ("(", "$("):
            self._pop()
        elif char == "[" and nxt == "[" and at_word_start and text[i + 2 : i + 3] in ("", " ", "\t", "\n"):
            self._push("[[")
            return 2
        elif char == "[" and (
            top in EVALUATED or top == "$[" or (top in CODE and NAME.fullmatch(context.word))
        ):
            self._push("[")
        elif char == "]" and nxt == "]" and top == "[[" and self.prev in (" ", "\t", "\n"):
            self._pop()
            return 2
        elif char == "]" and top in ("[", "$["):
            self._pop()
        return 1

    def _split(self, context: Context, chunk: str) -> None:
        """After `chunk` was added to a CODE context: a blank ends a word, `;`, `&`, `|` or a newline a command."""
        before = context.text[-len(chunk) - 1 : -len(chunk)]
        if chunk in ("&", "|") and before in ("<", ">"):  # `>&2`, `<&0`, `>|`: redirections
            context.duplicating = context.duplicating or chunk == "&"
            return
        if chunk not in (" ", "\t") and chunk not in COMMAND_BREAKS:
            return
        self._end_word(context, context.text[context.word_start : -1])
        context.word_start = len(context.text)
        if chunk in COMMAND_BREAKS:
            self._end_command(context)

    def _end_word(self, context: Context, raw: str) -> None:
        if not raw:
            return
        plain = _plain(raw)
        if plain.endswith(")") and "(" not in plain:  # a `case` pattern: a command follows it
            context.words = []
            return
        redirect = context.redirect_in_word or context.target_next
        context.target_next = context.redirect_in_word and bool(REDIRECT_OPERATOR.fullmatch(raw))
        context.duplicating = context.duplicating and context.target_next
        context.redirect_in_word = False
        context.words.append(Word(raw, plain, redirect))

    def _end_command(self, context: Context, final: bool = False) -> None:
        """A simple command ended: checks that need all its words, and what it tells about the template."""
        if final:
            self._end_word(context, context.text[context.word_start :])
            context.word_start = len(context.text)
        words = [word.raw for word in context.words if not word.redirect]
        for name, index in context.pending_tests:
            if (problem := _test_problem(words, index)) is not None:
                raise _evaluated_error(name, problem)
        context.pending_tests = []
        self._note_command(words)
        context.words, context.redirect_in_word, context.target_next, context.duplicating = (
            [],
            False,
            False,
            False,
        )

    def _note_command(self, words: list[str]) -> None:
        """Function definitions, aliases and commands that evaluate variables' values (for `finish`)."""
        plain = [_plain(word) for word in words]
        for k, word in enumerate(plain):
            if FUNCTION_HEADER.fullmatch(word):
                self.functions.add(word[:-2])
            elif word == "function" and k + 1 < len(plain):
                self.functions.add(plain[k + 1].removesuffix("()"))
            elif k + 1 < len(plain) and plain[k + 1] == "()":
                self.functions.add(word)
        start, _ = _skip_prefixes(plain)
        while start < len(plain) and ASSIGNMENT.match(plain[start]):
            start += 1
        if start >= len(plain):
            return
        command, args = plain[start], plain[start + 1 :]
        if command == "alias":
            self.aliases = True
        if not self.reader:
            if command in ("read", "mapfile", "readarray", "getopts") or command == "printf" and "-v" in args:
                self.reader = f"`{command}`"
            elif any(
                PLAIN_ASSIGNMENT.match(word) and ("$(" in word or "`" in word) for word in words[:start]
            ):
                self.reader = "an assignment from a command's output"
        if self.value_evaluator:
            return
        if command in VALUE_EVALUATORS:
            self.value_evaluator = f"`{command}`"
        elif command in DECLARATIONS and any(_evaluating_option(arg) for arg in args):
            self.value_evaluator = f"`{command}` with -i or -n (or an option that is not literal)"

    def problem(self) -> str | None:
        """Why a placeholder cannot be substituted here, or None when it can."""
        kinds = self.kinds
        if self.in_heredoc:
            return "inside a here-document body"
        if self.lost_in_case:
            return 'after a `case` inside "$(...)"'
        if "`" in kinds:
            return "inside backticks"
        if kinds[-1] == "#":
            return "inside a comment"
        if self.escaped:
            return "right after a backslash"
        if self.prev == "$":
            return "right after a `$`"
        if self._parameter_expansion_in_double_quotes():
            return "inside ${...} within double quotes"
        return None

    def check_position(self, name: str) -> None:
        """Raise TemplateError unless the placeholder about to be substituted is in an allowed position."""
        for kind in reversed(self.kinds):
            if kind in EVALUATED:
                raise _evaluated_error(name, EVALUATED[kind])
        for context in self.stack:
            if context.kind == "${" and not BRACE_WORD.match(context.text):
                raise _evaluated_error(
                    name,
                    "inside ${...} as a subscript, offset or name (only the word of ${NAME:-word} and the like "
                    "is text)",
                )
            if context.kind == "(" and context.opener:
                if ASSIGNMENT.fullmatch(_plain(context.opener)):
                    raise _evaluated_error(
                        name,
                        f"inside a compound array assignment {_plain(context.opener)}(...) (keys are evaluated)",
                    )
                if _plain(context.opener) not in ("<", ">"):  # not a process substitution: a pattern, `f(`
                    raise _refused_error(name, f"inside `{_plain(context.opener)}(...)`")
        # Each CODE level from the innermost out: its word that holds the placeholder (or the `$(…)` holding it)
        # must be in an allowed position. A subshell's or process substitution's output is not a word: stop there.
        depths = [k for k, context in enumerate(self.stack) if context.kind in CODE]
        for depth in reversed(depths):
            context = self.stack[depth]
            current = context.word + "".join(inner.text for inner in self.stack[depth + 1 :])
            self._check_word(name, context, current)
            if context.kind != "$(":
                break

    def _check_word(self, name: str, context: Context, current: str) -> None:
        if context.duplicating:  # `>& WORD` (no descriptor before it) expands WORD twice
            raise _evaluated_error(
                name, "the target of a `>&` or `<&` redirection (bash may expand it again)"
            )
        if context.redirect_in_word or context.target_next:
            before = context.words[-1].raw if context.target_next and context.words else ""
            if "<<<" in current or before.endswith("<<<"):
                self.assigned.append(name)  # a here-string is read into variables as often as not
            return  # a redirection's target: a file name or a here-string's text
        arguments = [word for word in context.words if not word.redirect]
        words = [word.raw for word in arguments] + [current]
        plain = [word.plain for word in arguments] + [_plain(current)]
        index = len(words) - 1
        start, prefix = _skip_prefixes(plain[:index])
        if start > index or (start == index and prefix in ("exec", "command", "builtin")):
            raise _refused_error(name, f"an option of `{prefix}`")
        while start < index and ASSIGNMENT.match(plain[start]):
            start += 1
        if start == index:
            if ASSIGNMENT.match(plain[index]):
                if not PLAIN_ASSIGNMENT.match(words[index]):
                    raise _evaluated_error(name, "in an assignment to an array element or with +=")
                self.assigned.append(name)
                return
            raise _refused_error(name, "the command name (or part of it)")
        command, raw_command = plain[start], words[start]
        if not LITERAL_NAME.fullmatch(command) or any(c in raw_command for c in "$`*?" + FIELD_MARK):
            raise _refused_error(name, "an argument of a command whose name is not a literal word")
        if command in KEYWORDS:
            if command == "[[":
                raise _evaluated_error(name, KEYWORDS[command])
            raise _refused_error(name, KEYWORDS[command])
        args, position = words[start + 1 :], index - start - 1
        if command in BUILTINS:
            self._check_builtin(name, context, command, args, position)
        self.called.append((name, command))

    def _check_builtin(
        self, name: str, context: Context, command: str, args: list[str], position: int
    ) -> None:
        kind = BUILTINS[command]
        if kind == SAFE:
            return
        if kind != CHECKED:
            raise _evaluated_error(name, f"an argument of `{command}` ({kind})")
        earlier = [_plain(arg) for arg in args[:position]]
        if command == "printf":
            if "-v" in earlier or any(arg.startswith("-v") for arg in earlier):
                raise _evaluated_error(
                    name, "after `printf -v` (a variable name, whose subscript is evaluated)"
                )
            formats = [arg for arg in args[:position] if _plain(arg) != "--"]
            if not formats or not _fixed_word(formats[0]) or _plain(formats[0]).startswith("-"):
                raise _refused_error(
                    name, "an argument of `printf` before a literal format (or the format itself)"
                )
        elif command in ("test", "["):
            for option in ("-v", "-R"):
                if option in earlier:
                    raise _evaluated_error(
                        name, f"after `{command} {option}` (a variable name, whose subscript is evaluated)"
                    )
            # Checked when the command ends, with all its words; the placeholder's is the next argument word.
            context.pending_tests.append((name, sum(not word.redirect for word in context.words)))
        elif command == "export":
            if any(arg.startswith("-") for arg in earlier):
                raise _evaluated_error(name, "an argument of `export` after an option")
            if not PLAIN_ASSIGNMENT.match(args[position]):
                raise _evaluated_error(name, "a variable name given to `export` (NAME={…} is fine)")
            self.assigned.append(name)

    def _parameter_expansion_in_double_quotes(self) -> bool:
        """A `${` with a `"` below it (and no `$(` between, which starts quoting afresh) keeps '…' literal."""
        kinds = self.kinds
        for depth, kind in enumerate(kinds):
            if kind != "${":
                continue
            for below in reversed(kinds[:depth]):
                if below == "$(":
                    break
                if below == '"':
                    return True
        return False

    def quote(self) -> str:
        """The quotes the next placeholder sits inside ("" when bare)."""
        kind = self.stack[-1].kind
        return kind if kind in QUOTES else ""

    def unterminated(self) -> str | None:
        """An opening quote or backtick never closed at the end of the template."""
        open_quotes = [kind for kind in self.kinds if kind in (*QUOTES, "`")]
        return open_quotes[-1] if open_quotes else None


def _plain(word: str) -> str:
    """A word without its quotes and backslashes (`"read"` is the builtin read)."""
    return re.sub(r"""['"\\]""", "", word)


def _skip_prefixes(plain: list[str]) -> tuple[int, str]:
    """Where a simple command's own words start past keywords, function headers and exec/command/builtin (with
    their options), and the last prefix skipped."""
    k, prefix = 0, ""
    while k < len(plain):
        word = plain[k]
        if word in PREFIX_KEYWORDS or FUNCTION_HEADER.fullmatch(word):
            k += 2 if word == "time" and plain[k + 1 : k + 2] == ["-p"] else 1
        elif word == "()" or word == "coproc":
            k += 2 if word == "coproc" and plain[k + 2 : k + 3] == ["{"] else 1
        elif word == "function":
            k += 3 if plain[k + 2 : k + 3] == ["()"] else 2
        elif word in ("exec", "command", "builtin"):
            k += 1
            while k < len(plain) and plain[k].startswith("-"):
                k += 2 if word == "exec" and plain[k] == "-a" else 1
        else:
            break
        prefix = word
    return k, prefix


def _fixed_word(raw: str) -> bool:
    """`raw` is one word whatever the values: no unquoted expansion that could split it or glob into several."""
    quote, escaped = "", False
    for char in raw:
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            if char == quote:
                quote = ""
            elif quote == '"' and char in "$`":
                continue
        elif char in "'\"":
            quote = char
        elif char in "$`*?[":
            return False
    return True


def _test_problem(words: list[str], index: int) -> str | None:
    """Why the placeholder at `words[index]` of a finished test/[ command is unsafe there, or None."""
    start, _ = _skip_prefixes([_plain(word) for word in words])
    while start < len(words) and ASSIGNMENT.match(_plain(words[start])):
        start += 1
    if not start < index < len(words):  # the words were cut (a `case` pattern): nothing to vouch for
        return "an argument of `test` or `[` in a command this check cannot follow"
    command = _plain(words[start])
    args = words[start + 1 :]
    position = index - start - 1
    if command == "[":
        if not args or _plain(args[-1]) != "]":
            return "an argument of `[` without its closing `]`"
        args = args[:-1]
    plain = [_plain(arg) for arg in args]
    if not all(_fixed_word(arg) for arg in args):
        return f"an argument of `{command}` beside an unquoted expansion (the number of arguments would vary)"
    fields = {k for k, arg in enumerate(args) if FIELD_MARK in arg}
    if len(args) == 1:
        return None
    if len(args) == 2 and plain[0] in TEST_UNARY and 0 not in fields:
        return None
    if len(args) == 3 and plain[1] in TEST_BINARY and 1 not in fields:
        return None
    return (
        f"an argument of `{command}` in a form other than `{command} WORD`, `{command} -n WORD` or "
        f"`{command} WORD = WORD` (a value such as -v would be an operator; argument {position + 1})"
    )


def _evaluating_option(word: str) -> bool:
    """`-i`, `-ai`, `-n`, or an option that is not literal: a declaration that makes assignments evaluated."""
    if not word or word[0] not in "-+" or word == "--":
        return False
    return bool(set(word[1:]) & {"i", "n"}) or not word[1:].isalnum()


class ShellTemplate:
    """A `cmd:` template, checked once at parse time; `render` substitutes values as literal shell words."""

    def __init__(self, template: str) -> None:
        self.template = template
        self.parts: list[str | Field] = _compile(template)

    @property
    def placeholders(self) -> set[str]:
        return {part.name for part in self.parts if isinstance(part, Field)}

    def render(self, values: Mapping[str, object]) -> str:
        """The bash command with every placeholder replaced by one word holding its value."""
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            value = _FORMATTER.convert_field(values[part.name], part.conversion)
            out.append(splice(format(value, part.format_spec), part.quote))
        return "".join(out)


def _word_at(text: str, i: int, word: str) -> bool:
    """`word` starts at i and ends at a word break (or the end of the text)."""
    end = i + len(word)
    return text.startswith(word, i) and (end == len(text) or text[end] in WORD_BREAKS)


def splice(value: str, quote: str) -> str:
    """`value` as shell text that reads as the literal value inside the given open quote ("" = none)."""
    quoted = shlex.quote(value)
    if not quote:
        return quoted
    return quote[-1] + quoted + quote  # close the quote, the quoted value, reopen ($'…' reopens with $')


def _literal_and_fields(template: str) -> list[tuple[str, tuple[str, str | None, str] | None]]:
    """(literal text, field) pairs, as str.format reads the template; braces in shell code must be doubled."""
    try:
        parsed = list(_FORMATTER.parse(template))
    except ValueError as exc:
        raise TemplateError(f"{exc} (write {{{{ and }}}} for literal braces)") from exc
    return [
        (literal, None if name is None else (name, conversion, spec or ""))
        for literal, name, spec, conversion in parsed
    ]


def _compile(template: str) -> list[str | Field]:
    scanner = QuotingScanner()
    parts: list[str | Field] = []
    for literal, placeholder in _literal_and_fields(template):
        if literal:
            scanner.feed(literal)
            if parts and isinstance(parts[-1], str):
                parts[-1] += literal  # str.format splits literal text at escaped braces
            else:
                parts.append(literal)
        if placeholder is None:
            continue
        name, conversion, spec = placeholder
        if name not in PLACEHOLDERS:
            raise TemplateError(
                f"unknown placeholder {{{name}}}; known: "
                + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
                + " (write {{ and }} for a brace)"
            )
        if "{" in spec:
            raise TemplateError(f"{{{name}}}: nested placeholders in a format spec are not supported")
        if (problem := scanner.problem()) is not None:
            raise TemplateError(
                f"{{{name}}} is {problem}, where no quoting keeps its value literal; put it outside "
                f'(values are shell-quoted for you) or use "${env_name(name)}" from the environment there'
            )
        scanner.check_position(name)
        scanner.fields.append(name)
        parts.append(Field(name, conversion, spec, scanner.quote()))
        scanner.after_field()
    if (quote := scanner.unterminated()) is not None:
        raise TemplateError(f"unterminated {quote} in the template")
    scanner.finish()
    return parts
