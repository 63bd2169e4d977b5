"""Who is calling: session and task ids, first match wins (documented in README, tested in test_gateway).

Session: header `x-polar-session` → proxy-auth user name (regular mode, `HTTPS_PROXY=http://SESSION:x@host:port`,
or `TASK/SESSION` with the slash written `%2F`) → a path prefix `/s/SESSION/…` (reverse mode; `/t/TASK/s/SESSION/…`
also names the task) → an API key `polar-SESSION` or `polar-TASK/SESSION` → one id per client connection.
Task: header `x-polar-task`, else the TASK part of whichever of the above carries one.

Secrets (API keys, Authorization, proxy credentials) are read here and never leave this module except as the
session/task ids the caller chose to put in them.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from urllib.parse import unquote

SECRET_HEADERS = frozenset({
    "authorization", "x-api-key", "x-goog-api-key", "proxy-authorization", "api-key", "openai-api-key",
    "cookie", "set-cookie", "x-stainless-api-key", "anthropic-api-key",
})
SECRET_QUERY_KEYS = frozenset({"key", "api_key", "apikey", "access_token"})
# Harness-native session ids worth keeping in the record.
HARNESS_ID_HEADERS = ("x-claude-code-session-id", "session-id", "session_id", "x-session-id", "conversation-id",
                      "conversation_id", "x-opencode-session", "x-gemini-session-id", "user-agent")
PATH_PREFIX = re.compile(r"^(?:/t/(?P<task>[^/]+))?/s/(?P<session>[^/]+)(?P<rest>/.*)?$")
API_KEY_PREFIX = "polar-"


@dataclass
class Identity:
    session_id: str
    task_id: str | None
    source: str  # header | proxy_auth | path | api_key | connection
    harness_ids: dict[str, str] = field(default_factory=dict)


def proxy_user(proxy_authorization: str | None) -> str | None:
    """The user name of a `Basic` Proxy-Authorization header (percent-decoded)."""
    if not proxy_authorization:
        return None
    scheme, _, value = proxy_authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user = base64.b64decode(value.strip()).decode("utf-8", "replace").partition(":")[0]
    except ValueError:
        return None
    return unquote(user) or None


def split_task(value: str) -> tuple[str | None, str]:
    """`TASK/SESSION` → (TASK, SESSION); `SESSION` → (None, SESSION)."""
    task, sep, session = value.rpartition("/")
    return (task or None, session) if sep and session else (None, value)


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
    m = PATH_PREFIX.match(path)
    if not m:
        return path, None, None
    return m.group("rest") or "/", unquote(m.group("task")) if m.group("task") else None, unquote(m.group("session"))


def resolve(headers: dict[str, str], path: str, query: dict[str, str], *, proxy_user_name: str | None,
            connection_id: str) -> tuple[Identity, str]:
    """The caller's identity, and the request path with any `/s/SESSION` prefix removed.

    `headers` must have lower-case names.
    """
    rest, path_task, path_session = strip_path_prefix(path)
    key = api_key_of(headers, query)
    key_task, key_session = (None, None)
    if key and key.startswith(API_KEY_PREFIX) and len(key) > len(API_KEY_PREFIX):
        key_task, key_session = split_task(key[len(API_KEY_PREFIX):])
    user_task, user_session = split_task(proxy_user_name) if proxy_user_name else (None, None)

    candidates = [
        ("header", headers.get("x-polar-task"), headers.get("x-polar-session")),
        ("proxy_auth", user_task, user_session),
        ("path", path_task, path_session),
        ("api_key", key_task, key_session),
    ]
    source, session = "connection", f"conn-{connection_id}"
    for name, _task, value in candidates:
        if value:
            source, session = name, value
            break
    task = headers.get("x-polar-task") or next((t for _, t, _s in candidates if t), None)
    harness_ids = {h: headers[h] for h in HARNESS_ID_HEADERS if headers.get(h)}
    return Identity(session_id=session, task_id=task, source=source, harness_ids=harness_ids), rest


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


def scrub_query(query: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in query.items() if k.lower() not in SECRET_QUERY_KEYS}
