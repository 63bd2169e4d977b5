"""`cmd:` harness templates: each placeholder becomes exactly one shell word that holds its value literally.

Task ids and prompts come from task files, so a value must never be parsed as shell syntax. Bare placeholders are
shell-quoted. A placeholder inside '…', "…" or $'…' is spliced: the quote is closed, the quoted value inserted, the
quote reopened (`"task {task}"` → `"task "'a;b'""`), which bash joins into one word. Where no quoting can keep a value
literal — a comment (a newline in the value ends it), backticks (a backtick in the value ends them), a here-document
body, `${…}` inside double quotes (single quotes are literal there), right after a backslash or a `$` — the template
is rejected when it is parsed, before any session starts; the same values are in the environment for those places.
"""

from __future__ import annotations

import shlex
import string
from collections.abc import Mapping
from dataclasses import dataclass

PLACEHOLDERS = ("prompt", "workspace", "session", "task", "index", "base_url", "proxy_url", "ca_bundle")
QUOTES = ("'", '"', "$'")  # the quoting contexts a value can be spliced into
WORD_BREAKS = frozenset(" \t\n;&|()<>")  # after one of these a `#` starts a comment
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


class QuotingScanner:
    """Follows bash's quoting through a template's literal text, so each placeholder knows its context.

    The stack holds the open contexts: "sh" (unquoted), "(" and "$(" (subshell / command substitution: quoting
    starts afresh inside), "${" (parameter expansion), the quotes, "`" and "#" (a comment, until the newline).
    """

    def __init__(self) -> None:
        self.stack: list[str] = ["sh"]
        self.escaped = False  # the last character was an unescaped backslash
        self.prev = ""  # the last character seen (a placeholder counts as a word character)
        self.heredoc_pending = False  # a `<<` was seen: its body starts at the next newline
        self.in_heredoc = False
        # A `case` pattern's unmatched `)` can end a "$(…)" early in this scanner's eyes; inside double quotes that
        # would misplace every later placeholder, so those are refused instead.
        self.lost_in_case = False

    def feed(self, text: str) -> None:
        """Advance over literal template text."""
        i = 0
        while i < len(text):
            i += self._step(text, i)

    def after_field(self) -> None:
        """A placeholder was substituted here: one word, so no comment can start right after it."""
        self.prev, self.escaped = "a", False

    def _step(self, text: str, i: int) -> int:
        """Consume the character at i (and a lookahead where bash does); returns how many were consumed."""
        char, top, nxt = text[i], self.stack[-1], text[i + 1: i + 2]
        consumed = 1
        if self.escaped:
            self.escaped = False
        elif top == "#":
            if char == "\n":
                self.stack.pop()
        elif top == "'":
            if char == "'":
                self.stack.pop()
        elif top in ("$'", "`", '"') and char == "\\":
            self.escaped = True
        elif top in ("$'", "`"):
            if char == top[-1]:
                self.stack.pop()
        elif top == '"':
            consumed = self._double_quoted(char, nxt)
        else:
            consumed = self._unquoted(char, nxt, text, i)
        self.prev = text[i + consumed - 1]
        return consumed

    def _double_quoted(self, char: str, nxt: str) -> int:
        if char == '"':
            self.stack.pop()
        elif char == "`":
            self.stack.append("`")
        elif char == "$" and nxt in ("(", "{"):
            self.stack.append("$" + nxt)
            return 2
        return 1

    def _unquoted(self, char: str, nxt: str, text: str, i: int) -> int:
        top = self.stack[-1]
        if char == "\\":
            self.escaped = True
        elif char == "$" and nxt in ("(", "{", "'"):
            self.stack.append("$" + nxt)
            return 2
        elif char in ("'", '"', "`"):
            self.stack.append(char)
        elif char == "(":
            self.stack.append("(")
        elif char == ")" and top in ("(", "$("):
            self.stack.pop()
        elif char == "}" and top == "${":
            self.stack.pop()
        elif char == "#" and top != "${" and (self.prev == "" or self.prev in WORD_BREAKS):
            self.stack.append("#")
        elif char == "c" and _word_at(text, i, "case") and (self.prev == "" or self.prev in WORD_BREAKS):
            self.lost_in_case = self.lost_in_case or '"' in self.stack
        elif char == "<" and nxt == "<" and text[i + 2: i + 3] != "<" and self.prev != "<":
            self.heredoc_pending = True
            return 2
        elif char == "\n" and self.heredoc_pending:
            self.in_heredoc = True  # conservative: the rest of the template is treated as the body
        return 1

    def problem(self) -> str | None:
        """Why a placeholder cannot be substituted here, or None when it can."""
        if self.in_heredoc:
            return "inside a here-document body"
        if self.lost_in_case:
            return 'after a `case` inside "$(...)"'
        if "`" in self.stack:
            return "inside backticks"
        if self.stack[-1] == "#":
            return "inside a comment"
        if self.escaped:
            return "right after a backslash"
        if self.prev == "$":
            return "right after a `$`"
        if self._parameter_expansion_in_double_quotes():
            return "inside ${...} within double quotes"
        return None

    def _parameter_expansion_in_double_quotes(self) -> bool:
        """A `${` with a `"` below it (and no `$(` between, which starts quoting afresh) keeps '…' literal."""
        for depth, context in enumerate(self.stack):
            if context != "${":
                continue
            for below in reversed(self.stack[:depth]):
                if below == "$(":
                    break
                if below == '"':
                    return True
        return False

    def quote(self) -> str:
        """The quotes the next placeholder sits inside ("" when bare)."""
        return self.stack[-1] if self.stack[-1] in QUOTES else ""

    def unterminated(self) -> str | None:
        """An opening quote or backtick never closed at the end of the template."""
        open_quotes = [c for c in self.stack if c in (*QUOTES, "`")]
        return open_quotes[-1] if open_quotes else None


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
    return [(literal, None if name is None else (name, conversion, spec or ""))
            for literal, name, spec, conversion in parsed]


def _compile(template: str) -> list[str | Field]:
    scanner = QuotingScanner()
    parts: list[str | Field] = []
    for literal, field in _literal_and_fields(template):
        if literal:
            scanner.feed(literal)
            if parts and isinstance(parts[-1], str):
                parts[-1] += literal  # str.format splits literal text at escaped braces
            else:
                parts.append(literal)
        if field is None:
            continue
        name, conversion, spec = field
        if name not in PLACEHOLDERS:
            raise TemplateError(f"unknown placeholder {{{name}}}; known: "
                                + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS) + " (write {{ and }} for a brace)")
        if "{" in spec:
            raise TemplateError(f"{{{name}}}: nested placeholders in a format spec are not supported")
        if (problem := scanner.problem()) is not None:
            raise TemplateError(
                f"{{{name}}} is {problem}, where no quoting keeps its value literal; put it outside "
                f"(values are shell-quoted for you) or use \"${env_name(name)}\" from the environment there")
        parts.append(Field(name, conversion, spec, scanner.quote()))
        scanner.after_field()
    if (quote := scanner.unterminated()) is not None:
        raise TemplateError(f"unterminated {quote} in the template")
    return parts
