"""Untrusted text on a terminal: session and task ids, file names, error messages and decoded tokens come from
harnesses, models and files, so they are shown, never interpreted — no Rich markup, no escape sequences."""

from __future__ import annotations

import re

from rich.markup import escape
from rich.text import Text

# C0/C1 controls (ESC starts terminal sequences, BEL, CR rewrite lines) and the bidi overrides that reorder
# what is displayed. Tab and newline are kept only where a text is meant to span lines.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_CONTROLS_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, *, multiline: bool = False) -> str:
    """`text` with every control character replaced by its visible escape (`\\x1b`)."""
    pattern = _CONTROLS_BUT_LINES if multiline else _CONTROLS
    return pattern.sub(_visible, str(text))


def markup_safe(text: object, *, multiline: bool = False) -> str:
    """`text` for a Rich markup string: control characters made visible, `[` escaped."""
    return escape(printable(text, multiline=multiline))


def plain(text: object, style: str = "", *, multiline: bool = False) -> Text:
    """`text` as a Rich Text (never parsed as markup), control characters made visible."""
    return Text(printable(text, multiline=multiline), style=style)
