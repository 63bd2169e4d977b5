"""Session identities on the wire: how a caller names its session (and task) to the gateway, built and parsed here.

A harness, a rollout spec or a test builds one of these forms; the gateway (`gateway/identity.py`, which decides
which header or path to look at) parses it back:

- path prefix `/t/TASK/s/SESSION` or `/s/SESSION` (reverse mode), each id percent-encoded as one path segment;
- proxy user name `TASK%2FSESSION` or `SESSION` (regular mode, `HTTPS_PROXY=http://USER:x@host:port`), each id
  percent-encoded, the slash between them too;
- API key `polar-TASK/SESSION` or `polar-SESSION`, for clients that hide both the base URL and the proxy;
- the compact form `TASK/SESSION` or `SESSION` inside the last two, split at the last slash: a task id may hold
  '/', a session id may not (harness/base.py's `id_problem` rejects it before any of these is built).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote

API_KEY_PREFIX = "polar-"
PATH_PREFIX = re.compile(r"^(?:/t/(?P<task>[^/]+))?/s/(?P<session>[^/]+)(?P<rest>/.*)?$")
# A proxy user name carries no password; clients still need one to send the user name.
PROXY_PASSWORD = "x"


@dataclass(frozen=True)
class SessionId:
    """A session id and, optionally, the task it belongs to (an empty task is no task)."""

    session: str
    task: str | None = None

    @property
    def compact(self) -> str:
        """`TASK/SESSION`, or `SESSION` when there is no task."""
        return f"{self.task}/{self.session}" if self.task else self.session

    @property
    def path_prefix(self) -> str:
        """`/t/TASK/s/SESSION` or `/s/SESSION`: the reverse gateway strips it from the path and records the ids."""
        session = f"/s/{quote(self.session, safe='')}"
        return f"/t/{quote(self.task, safe='')}{session}" if self.task else session

    def base_url(self, gateway_url: str, suffix: str = "") -> str:
        """The gateway's reverse URL with this path prefix, plus a provider suffix such as `/v1`."""
        return gateway_url.rstrip("/") + self.path_prefix + suffix

    @property
    def proxy_user(self) -> str:
        """`TASK%2FSESSION` or `SESSION`: the user name of the gateway's proxy URL."""
        session = quote(self.session, safe="")
        return f"{quote(self.task, safe='')}%2F{session}" if self.task else session

    def proxy_url(self, host_port: str, scheme: str = "http") -> str:
        """`http://TASK%2FSESSION:x@host:port`: every harness sends this user name on CONNECT."""
        return f"{scheme}://{self.proxy_user}:{PROXY_PASSWORD}@{host_port}"

    @property
    def api_key(self) -> str:
        """`polar-TASK/SESSION` or `polar-SESSION`."""
        return f"{API_KEY_PREFIX}{self.compact}"


def parse_compact(value: str | None) -> SessionId | None:
    """`TASK/SESSION` → SessionId(SESSION, TASK); `SESSION` (or a value ending in '/') → SessionId(value)."""
    if not value:
        return None
    task, sep, session = value.rpartition("/")
    return SessionId(session, task or None) if sep and session else SessionId(value)


def parse_path(path: str) -> tuple[SessionId | None, str]:
    """(the ids, `/rest`) for `/t/TASK/s/SESSION/rest`; (None, path) for a path without the prefix."""
    m = PATH_PREFIX.match(path)
    if not m:
        return None, path
    task = unquote(m.group("task")) if m.group("task") else None
    return SessionId(unquote(m.group("session")), task), m.group("rest") or "/"


def decode_proxy_user(user: str) -> str:
    """A proxy user name as sent (`TASK%2FSESSION`) → its compact form (`TASK/SESSION`)."""
    return unquote(user)


def parse_proxy_user(user: str | None) -> SessionId | None:
    """The ids in a proxy user name as sent (percent-encoded); None for an empty one."""
    return parse_compact(decode_proxy_user(user)) if user else None


def parse_api_key(key: str | None) -> SessionId | None:
    """The ids in a `polar-…` API key; None for any other key (a real provider key names no session)."""
    if not key or not key.startswith(API_KEY_PREFIX):
        return None
    return parse_compact(key[len(API_KEY_PREFIX) :])
