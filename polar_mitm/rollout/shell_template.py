"""`cmd:` harness templates: each placeholder becomes exactly one shell word that holds its value literally.

Task ids and prompts come from task files, so a value must never be parsed as shell syntax. Bare placeholders are
shell-quoted. A placeholder inside '…', "…" or $'…' is spliced: the quote is closed, the quoted value inserted, the
quote reopened (`"task {task}"` → `"task "'a;b'""`), which bash joins into one word. Where no quoting can keep a value
literal — a comment (a newline in the value ends it), backticks (a backtick in the value ends them), a here-document
body, `${…}` inside double quotes (single quotes are literal there), right after a backslash or a `$` — the template
is rejected when it is parsed, before any session starts; the same values are in the environment for those places.

Quoting is not enough where bash *evaluates* a word's value: arithmetic (`$((…))`, `((…))`, `$[…]`, `let`, an array
subscript `NAME[…]` or `${NAME[…]}`, a `${…}` offset, assignments after `declare -i`) and `[[ … ]]` evaluate a
variable name with a subscript in the value, so `a[$(touch F)]` runs `touch F` however it is quoted; builtins that take
variable names (`read`, `unset`, `printf -v`, `test -v`, `declare NAME`, …) do the same. Those places are refused
too, conservatively, and the environment variable is no way around it there: compare or pass the value as text.
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
NAME_ARGUMENTS = frozenset(
    {"read", "unset", "mapfile", "readarray", "getopts", "let", "wait"}
)  # args are names
DECLARATIONS = frozenset({"declare", "typeset", "local", "export", "readonly"})
NAME_OPTIONS = frozenset({"-v", "-R"})  # printf -v NAME, test -v NAME, [ -R NAME ]
PREFIX_WORDS = frozenset(
    {"if", "then", "else", "elif", "do", "while", "until", "!", "{", "time", "builtin", "command", "exec"}
)  # before a command name
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\[[^\]]*\])?\+?=")
# `${NAME op word}` where the word is plain text (defaults, patterns, replacements), not a subscript or an offset.
BRACE_WORD = re.compile(
    r"(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-])(?:\[[^\]]*\])?"
    r"(?::?[-=+?]|##?|%%?|/[/#%]?|\^\^?|,,?)"
)
FIELD_MARK = "\ue000"  # stands for a substituted placeholder in the text a context has seen
_FORMATTER = string.Formatter()


class TemplateError(ValueError):
    """A `cmd:` template that cannot be substituted safely (or names an unknown placeholder)."""


def env_name(placeholder: str) -> str:
    """The environment variable that carries a placeholder's value (`prompt` → `POLAR_PROMPT`)."""
    return f"POLAR_{placeholder.upper()}"


@dataclass(frozen=True)
class Field:
    """One placeholder of a template and the quotes it sits inside ("" when bare)."""

    name: str
    conversion: str | None
    format_spec: str
    quote: str


@dataclass
class Context:
    """One open context of the scanner and the template text seen inside it (nested contexts' text included)."""

    kind: str
    text: str = ""
    words: list[str] = field(default_factory=list)  # CODE contexts: the finished words of the current command
    word_start: int = 0  # CODE contexts: where the current word starts in `text`

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
        self.integer_declared = False  # `declare -i`/`-n` seen: later assignments to that name are evaluated

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

    def _push(self, kind: str) -> None:
        self.stack.append(Context(kind))

    def _pop(self) -> None:
        inner = self.stack.pop()
        self.stack[-1].text += inner.text

    def _step(self, text: str, i: int) -> int:
        """Consume the character at i (and a lookahead where bash does); returns how many were consumed."""
        owner, was_escaped = self.stack[-1], self.escaped
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
        (owner if any(context is owner for context in self.stack) else self.stack[-1]).text += text[
            i : i + consumed
        ]
        current = self.stack[-1]
        if current.kind in CODE and not was_escaped and (current is owner or top == "#"):
            self._split(current, char)
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

    def _split(self, context: Context, char: str) -> None:
        """After `char` was added to a CODE context: a blank ends a word, `;`, `&`, `|` or a newline a command."""
        if char not in " \t" and char not in COMMAND_BREAKS:
            return
        word = _plain(context.text[context.word_start : -1])
        context.word_start = len(context.text)
        if word.endswith(")") and "(" not in word:  # a `case` pattern: a command follows it
            context.words = []
        elif word:
            context.words.append(word)
            command, args = _command(context.words)
            if command in DECLARATIONS and args and _integer_option(args[-1]):
                self.integer_declared = True
        if char in COMMAND_BREAKS:
            context.words = []

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

    def evaluated(self) -> str | None:
        """Where bash would evaluate the placeholder's value (arithmetic, a variable name), or None."""
        for kind in reversed(self.kinds):
            if kind in EVALUATED:
                return EVALUATED[kind]
        for context in self.stack:
            if context.kind == "${" and not BRACE_WORD.match(context.text):
                return (
                    "inside ${...} as a subscript, offset or name (only the word of ${NAME:-word} and the like "
                    "is text)"
                )
        if (problem := self._argument_problem()) is not None:
            return problem
        if self.integer_declared:
            return "after `declare -i` or `-n` (assignments to such a variable are evaluated)"
        return None

    def _argument_problem(self) -> str | None:
        """A placeholder that a builtin would take as a variable name (bash evaluates a subscript in it)."""
        depth = max(k for k, context in enumerate(self.stack) if context.kind in CODE)
        context = self.stack[depth]
        current = _plain(context.word + "".join(inner.text for inner in self.stack[depth + 1 :]))
        command, args = _command([*context.words, current])
        if not args:  # the placeholder is the command name, or in an assignment before it
            return None
        earlier = args[:-1]
        if command in NAME_ARGUMENTS:
            return f"an argument of `{command}` (it takes variable names, and evaluates their subscripts)"
        if command in DECLARATIONS:
            if any(_integer_option(arg) for arg in earlier):
                return f"an argument of `{command}` with -i or -n (the value is evaluated)"
            if not ASSIGNMENT.match(current):
                return (
                    f"a variable name given to `{command}` (its subscript is evaluated; NAME={{…}} is fine)"
                )
        option = next((arg for arg in earlier if arg in NAME_OPTIONS), None)
        if command in ("printf", "test", "[") and option is not None:
            return f"after `{command} {option}` (a variable name, whose subscript is evaluated)"
        return None

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


def _command(words: list[str]) -> tuple[str, list[str]]:
    """The command name of a simple command's (plain) words and its arguments, past assignments and keywords."""
    k = 0
    while k < len(words) and (ASSIGNMENT.match(words[k]) or words[k] in PREFIX_WORDS):
        k += 1
    return (words[k], words[k + 1 :]) if k < len(words) else ("", [])


def _integer_option(word: str) -> bool:
    """`-i`, `-ai`, `-n`, …: a declaration option that makes assignments evaluated (integer, nameref)."""
    return len(word) > 1 and word[0] in "-+" and word[1] != "-" and bool(set(word[1:]) & {"i", "n"})


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
        if (problem := scanner.evaluated()) is not None:
            raise TemplateError(
                f"{{{name}}} is {problem}, where bash evaluates the value whatever its quoting (a value such as "
                f"a[$(cmd)] runs cmd; ${env_name(name)} is no safer there); use it as plain text instead, "
                f"e.g. [ {{{name}}} = x ]"
            )
        parts.append(Field(name, conversion, spec, scanner.quote()))
        scanner.after_field()
    if (quote := scanner.unterminated()) is not None:
        raise TemplateError(f"unterminated {quote} in the template")
    return parts
