"""Rendering only what a call adds to its chain's tip, for chat templates where that is proved equal to a full render.

Tokens mode needs each call's full rendered prompt (routing compares it with the chain tips; the tail after the tip
is tokenized). Re-rendering the whole conversation with jinja costs ~35 µs per message (the sandbox's attribute
checks), 10 ms for a 300-message session. Here a call that extends a tip's exact messages is rendered as

    tip text without its generation prompt  +  a window render of (the head messages + the new messages), cut

and that text is *equal* to the full render, not a guess, for the templates listed in LOCAL_TEMPLATES, by this
argument (read against polar_mitm/engine/templates/qwen3.jinja; smollm2.jinja is the same body after it prepends a
default system message, which it does alike for a window and for the whole list, since both start with M[0]):

  T(M) = H + B_0 + … + B_{n-1} + F, where H (system/tools header) depends only on tools and M[0]; F (generation
  prompt) only on the template kwargs; and block B_i only on M[i], i == 0, i == n-1, whether M[i-1] and M[i+1] are
  tool messages, and whether i > q, q being the last "query" (a user message whose string content is not a
  wrapped tool response; n-1 when there is none). Loop variables do not leak between iterations in jinja.

Let the tip have rendered M[:k] (the same messages, tools and kwargs) as P + F, and let the window be
W = head + M[k:], head = [M[0]] plus M[q] when the tip's query q ≥ 1. Then, when `window_safe` accepts:

  - no query among M[k:]: q is unchanged, so every assistant block i < k is as in the tip, and every assistant block
    i ≥ k sees i > q both in M and in W (W's own query is its head's last message, or neither list has one);
  - M[k-1] is not an assistant (its block would see `loop.last` change) and not a tool followed by a tool (its
    end-of-turn, and the tool grouping of M[k], depend on that neighbour; W puts M[0]/M[q] before M[k]);
  - M[0] is a system or user message: its block, like M[q]'s, reads neither `loop.last` nor neighbours.

So T(M) = P + (T(W) minus T(head) without generation prompt) — checked cheaply on the strings too. A retry (the
tip's very messages, tools and kwargs) is the tip's text: these templates read nothing else (no date). Any other
template, or a call that does not meet the conditions, is rendered in full (renderer.py), and a chain's first call
is still checked against the engine's own ids (prompts.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# sha256 of the template texts the argument above was made for; a changed template is rendered in full until its
# own argument is made (tests/gateway/test_incremental_render.py checks these are the project's templates).
LOCAL_TEMPLATES = {
    "qwen3": "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
    "smollm2": "fc0c02cabc89140a44054e2ce8ae9261cdc383c4e24eeb3e974d71f130739503",
}


def template_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def is_local(text: str) -> bool:
    """Whether a template is one the incremental argument holds for."""
    return template_hash(text) in LOCAL_TEMPLATES.values()


@dataclass(frozen=True)
class Head:
    """A tip's window head and its renders: the same for every call that extends the tip (same first messages, no
    new query), and passed on to the tip that call becomes — so a call renders one window, not three."""

    query: int | None  # index of the last query among the tip's messages (None: there is none)
    bare: str  # T(head) without the generation prompt
    footer: str  # F: what the generation prompt adds


@dataclass(frozen=True)
class RenderedTip:
    """What a chain tip's text was rendered from (the engine request's messages, tools and template kwargs)."""

    messages: list[dict[str, Any]]
    tools: list | None
    kwargs: dict[str, Any]
    text: str
    head: Head | None = None


Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> text


def render_after_tip(
    messages: list[dict[str, Any]],
    tools: list | None,
    kwargs: dict[str, Any],
    tips: Sequence[RenderedTip],
    render: Render,
) -> RenderedTip | None:
    """The full rendering of `messages` (as the tip it makes), built from the tip with the most messages it extends;
    None when not proved (no such tip, or a call outside the conditions of the module docstring)."""
    for tip in tips:
        k = len(tip.messages)
        if k > len(messages) or tip.tools != tools or tip.kwargs != kwargs or messages[:k] != tip.messages:
            continue
        if k == len(messages):  # a retry: the same inputs, and these templates read nothing else (no date)
            return tip
        if not window_safe(messages, k):
            return None
        try:
            head = tip.head or make_head(messages, k, render)
            if head is None:
                return None
            window = render([*head_messages(messages, head.query), *messages[k:]], True)
        except (
            Exception
        ) as exc:  # a window the template refuses: the full render decides (and raises if it must)
            log.debug("incremental rendering refused by the template: %s", exc)
            return None
        if not (window.startswith(head.bare) and tip.text.endswith(head.footer)):
            return None  # the template did not split as argued: never build on it
        text = tip.text[: len(tip.text) - len(head.footer)] + window[len(head.bare) :]
        return RenderedTip(list(messages), tools, kwargs, text, head)
    return None


def window_safe(messages: list[dict[str, Any]], k: int) -> bool:
    """Whether messages[k:] may be rendered in a window after the tip messages[:k] (the module docstring's
    conditions)."""
    first, last_tip, first_new = messages[0], messages[k - 1], messages[k]
    if first.get("role") not in ("system", "user") or last_tip.get("role") == "assistant":
        return False
    if last_tip.get("role") == "tool" and first_new.get("role") == "tool":
        return False
    return not any(is_query(message) for message in messages[k:])  # a new query hides earlier thinking


def make_head(messages: list[dict[str, Any]], k: int, render: Render) -> Head | None:
    """The window head of the tip messages[:k], rendered without and with the generation prompt."""
    query = next((i for i in range(k - 1, -1, -1) if is_query(messages[i])), None)
    head = head_messages(messages, query)
    bare, prompted = render(head, False), render(head, True)
    return Head(query, bare, prompted[len(bare) :]) if prompted.startswith(bare) else None


def head_messages(messages: list[dict[str, Any]], query: int | None) -> list[dict[str, Any]]:
    """M[0], then M[q] when the last query q is a later message: a window's own last query is then q itself."""
    return [messages[0]] if not query else [messages[0], messages[query]]


def is_query(message: dict[str, Any]) -> bool:
    """The template's test for the last user query (`ns.last_query_index`)."""
    content = message.get("content")
    return (
        message.get("role") == "user"
        and isinstance(content, str)
        and not (content.startswith("<tool_response>") and content.endswith("</tool_response>"))
    )
