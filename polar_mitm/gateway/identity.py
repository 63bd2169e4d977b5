"""Who is calling: session and task ids, first match wins (documented in README, tested in test_gateway).

Session: proxy-auth user name (regular mode, `HTTPS_PROXY=http://SESSION:x@host:port`, or `TASK/SESSION` with the
slash written `%2F`) → a path prefix `/s/SESSION/…` (reverse mode; `/t/TASK/s/SESSION/…` also names the task) →
header `x-polar-session` → an API key `polar-SESSION` or `polar-TASK/SESSION` → one id per client connection.
Task: a session bound by its proxy user or path takes its task from there only; otherwise header `x-polar-task`,
else the TASK part of whichever form carries one. A rollout's gateway (started with a session key) takes only forms
whose session credential matches their ids (`session_ids.credential`) and refuses every other call.

The forms themselves (how each is built and parsed) live in `polar_mitm/session_ids.py`; this module decides
which header, path or key to read them from.

Secrets (API keys, Authorization, proxy credentials) are read here and never leave this module except as the
session/task ids the caller chose to put in them; `scrub_credentials` removes them from a request before it is
handled, logged or saved.
"""

from __future__ import annotations

import base64
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from polar_mitm import session_ids
from polar_mitm.session_ids import SessionId

SECRET_HEADERS = frozenset(
    {
        "authorization",
        "x-api-key",
        "x-goog-api-key",
        "proxy-authorization",
        "api-key",
        "openai-api-key",
        "cookie",
        "set-cookie",
        "x-stainless-api-key",
        "anthropic-api-key",
    }
)
SECRET_QUERY_KEYS = frozenset({"key", "api_key", "apikey", "access_token"})
# Harness-native session ids worth keeping in the record.
HARNESS_ID_HEADERS = (
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "x-session-id",
    "conversation-id",
    "conversation_id",
    "x-opencode-session",
    "x-gemini-session-id",
    "user-agent",
)


@dataclass
class Identity:
    session_id: str
    task_id: str | None
    source: str  # header | proxy_auth | path | api_key | connection
    harness_ids: dict[str, str] = field(default_factory=dict)


def proxy_user(proxy_authorization: str | None) -> str | None:
    """The user name of a `Basic` Proxy-Authorization header, decoded to its compact form `TASK/SESSION`, with the
    password after `session_ids.PASSWORD_SEPARATOR` (a rollout session's credential rides there)."""
    if not proxy_authorization:
        return None
    scheme, _, value = proxy_authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(value.strip()).decode("utf-8", "replace").partition(":")
    except ValueError:
        return None
    user = session_ids.decode_proxy_user(user)
    if not user:
        return None
    if password and password != session_ids.PROXY_PASSWORD:
        return f"{user}{session_ids.PASSWORD_SEPARATOR}{password}"
    return user


def api_key_of(headers: dict[str, str], query: dict[str, str]) -> str | None:
    for name in ("x-api-key", "x-goog-api-key", "api-key"):
        if headers.get(name):
            return headers[name]
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return query.get("key")


def strip_path_prefix(path: str) -> tuple[str, str | None, str | None]:
    """(`/rest`, task, session) for `/t/TASK/s/SESSION/rest`; (path, None, None) otherwise."""
    ids, rest = session_ids.parse_path(path)
    return (rest, ids.task, ids.session) if ids else (path, None, None)


class SessionRefused(Exception):
    """A call to a gateway that serves a rollout's sessions without a valid session credential (answered 401)."""


BOUND_SOURCES = (
    "proxy_auth",
    "path",
)  # the session's own hook-up: headers a harness sends cannot override it


def resolve(
    headers: dict[str, str],
    path: str,
    query: dict[str, str],
    *,
    proxy_user_name: str | None,
    connection_id: str,
    session_key: str | None = None,
) -> tuple[Identity, str]:
    """The caller's identity, and the request path with any `/s/SESSION` prefix removed.

    A session bound by its proxy user or its URL path is that session, whatever `x-polar-session`/`x-polar-task`
    headers say (any code in a session can add headers; the hook-up is the rollout's). With `session_key` (a
    rollout's gateway), only an identity whose credential matches its ids counts, headers never do, and a call
    without one raises SessionRefused.

    `headers` must have lower-case names.
    """
    path_ids, rest = session_ids.parse_path(path)
    harness_ids = {h: headers[h] for h in HARNESS_ID_HEADERS if headers.get(h)}
    carried: list[tuple[str, SessionId | None]] = [
        ("proxy_auth", session_ids.parse_compact(proxy_user_name)),
        ("path", path_ids),
        ("header", SessionId(headers.get("x-polar-session") or "", headers.get("x-polar-task"))),
        ("api_key", session_ids.parse_api_key(api_key_of(headers, query))),
    ]
    candidates = [(name, ids) for name, ids in carried if ids and ids.session]
    if session_key is not None:
        for name, ids in candidates:
            if name != "header" and ids.verified(session_key):
                return Identity(ids.session, ids.task, name, harness_ids), rest
        raise SessionRefused(
            "this gateway serves a rollout's sessions: the call carries no valid session credential "
            "(use the base URL, proxy URL or API key the rollout gave this session)"
        )
    if not candidates:
        return Identity(f"conn-{connection_id}", None, "connection", harness_ids), rest
    source, ids = candidates[0]
    task = ids.task
    if source not in BOUND_SOURCES and task is None:  # an unbound session may take its task from another form
        task = next((other.task for _, other in carried if other and other.task), None)
    return Identity(session_id=ids.session, task_id=task, source=source, harness_ids=harness_ids), rest


def safe_text(value: str) -> str:
    """`value` as valid UTF-8 text: bytes that were not UTF-8 (lone surrogates from a lenient decode) → U+FFFD."""
    if value.isascii():
        return value
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate surrogateescape never produces
        return value.encode("utf-8", "replace").decode("utf-8")


def scrub_headers(headers: dict[str, str]) -> dict[str, str]:
    """Headers without credentials (safe to record or log)."""
    return {k: v for k, v in headers.items() if k.lower() not in SECRET_HEADERS}


@dataclass
class Credentials:
    """The credential headers and query parameters taken off a request (see `take_credentials`)."""

    headers: list[tuple[str, str]] = field(default_factory=list)
    query: list[tuple[str, str]] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


def take_credentials(headers: Any, query: Any) -> Credentials:
    """Remove every credential from a mitmproxy request's `headers` and `query` (multidicts) and return them.

    The first thing done with a request, so no later failure can leave a secret in the flow; identity reads them
    back from the returned value, and a request forwarded upstream gets them back (`restore_credentials`).
    """
    taken = Credentials(
        headers=[(k, v) for k, v in _pairs(headers) if k.lower() in SECRET_HEADERS],
        query=[(k, v) for k, v in _pairs(query) if k.lower() in SECRET_QUERY_KEYS],
    )
    if taken.headers or taken.query:
        scrub_credentials(headers, query)
    return taken


def _pairs(mapping: Any) -> list[tuple[str, str]]:
    """Every (name, value) of a mitmproxy multidict (repeated names too) or a plain mapping."""
    try:
        return list(mapping.items(multi=True))
    except TypeError:
        return list(mapping.items())


def restore_credentials(headers: Any, query: Any, taken: Credentials | None) -> None:
    """Put taken credentials back on a request that is forwarded to the real provider."""
    if taken is None:
        return
    for name, value in taken.headers:
        headers.add(name, value)
    for key, value in taken.query:
        query.add(key, value)


def scrub_credentials(headers: MutableMapping[str, str], query: MutableMapping[str, str]) -> None:
    """Remove every credential header and query parameter in place (idempotent).

    Takes any mutable mappings with case-insensitive deletion by name, such as a mitmproxy request's `headers`
    and `query` multidicts (deleting a name removes all its values).
    """
    for name in [k for k in headers.keys() if k.lower() in SECRET_HEADERS]:
        del headers[name]
    for key in [k for k in query.keys() if k.lower() in SECRET_QUERY_KEYS]:
        del query[key]
