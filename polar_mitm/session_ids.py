"""Session identities on the wire: how a caller names its session (and task) to the gateway, built and parsed here.

A harness, a rollout spec or a test builds one of these forms; the gateway (`gateway/identity.py`, which decides
which header or path to look at) parses it back:

- path prefix `/t/TASK/s/SESSION` or `/s/SESSION` (reverse mode), each id percent-encoded as one path segment;
- proxy user name `TASK%2FSESSION` or `SESSION` (regular mode, `HTTPS_PROXY=http://USER:x@host:port`), each id
  percent-encoded, the slash between them too;
- API key `polar-TASK/SESSION` or `polar-SESSION`, for clients that hide both the base URL and the proxy;
- the compact form `TASK/SESSION` or `SESSION` inside the last two, split at the last slash: a task id may hold
  '/', a session id may not (harness/base.py's `id_problem` rejects it before any of these is built).

A rollout's sessions also carry a **session credential** (issue 36 item 10): `credential(key, ids)`, an HMAC of the
task and session ids under the key only the rollout and its gateway hold, so a session cannot write into another
session by naming its ids (they are on every harness command line). It rides in each form: a path segment
`/t/TASK/s/SESSION/c/CRED`, the proxy password (`http://TASK%2FSESSION:CRED@host:port`), the API key
`polarc-CRED-TASK/SESSION`. A gateway started with the key serves only calls whose credential matches their ids.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, replace
from urllib.parse import quote, unquote

API_KEY_PREFIX = "polar-"
CREDENTIAL_KEY_PREFIX = (
    "polarc-"  # polarc-CRED-TASK/SESSION: CRED has a fixed length, so the split is unambiguous
)
CREDENTIAL_CHARS = 32  # hex digits of HMAC-SHA256: 128 bits
PATH_PREFIX = re.compile(
    r"^(?:/t/(?P<task>[^/]+))?/s/(?P<session>[^/]+)(?:/c/(?P<credential>[0-9a-f]{32}))?(?P<rest>/.*)?$"
)
# A proxy user name without a credential carries no password; clients still need one to send the user name.
PROXY_PASSWORD = "x"
# Joins a proxy user name and its password in the one string the gateway passes on: a control character, which no
# id may hold (harness/base.py's id_problem), so it cannot be forged inside an id.
PASSWORD_SEPARATOR = "\x1f"


def credential(key: str, task: str | None, session: str) -> str:
    """The session credential of (task, session) under `key`: what only the key's holders can compute."""
    message = f"{task or ''}\x00{session}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()[:CREDENTIAL_CHARS]


@dataclass(frozen=True)
class SessionId:
    """A session id and, optionally, the task it belongs to (an empty task is no task)."""

    session: str
    task: str | None = None
    credential: str | None = None  # the session credential, when a rollout's gateway asks for one

    def signed(self, key: str | None) -> SessionId:
        """These ids with their credential under `key` (unchanged when there is no key)."""
        return replace(self, credential=credential(key, self.task, self.session)) if key else self

    def verified(self, key: str) -> bool:
        """Does this carry the credential `key` gives its ids? (constant time)"""
        return self.credential is not None and hmac.compare_digest(
            self.credential, credential(key, self.task, self.session)
        )

    @property
    def compact(self) -> str:
        """`TASK/SESSION`, or `SESSION` when there is no task."""
        return f"{self.task}/{self.session}" if self.task else self.session

    @property
    def path_prefix(self) -> str:
        """`/t/TASK/s/SESSION` or `/s/SESSION`: the reverse gateway strips it from the path and records the ids."""
        session = f"/s/{quote(self.session, safe='')}"
        if self.credential:
            session += f"/c/{self.credential}"
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
        return f"{scheme}://{self.proxy_user}:{self.credential or PROXY_PASSWORD}@{host_port}"

    @property
    def api_key(self) -> str:
        """`polar-TASK/SESSION` or `polar-SESSION`; with a credential `polarc-CRED-TASK/SESSION`."""
        if self.credential:
            return f"{CREDENTIAL_KEY_PREFIX}{self.credential}-{self.compact}"
        return f"{API_KEY_PREFIX}{self.compact}"


def parse_compact(value: str | None, credential: str | None = None) -> SessionId | None:
    """`TASK/SESSION` → SessionId(SESSION, TASK); `SESSION` (or a value ending in '/') → SessionId(value); a
    proxy user name as the gateway passes it on (`USER` + PASSWORD_SEPARATOR + password) brings its credential."""
    if not value:
        return None
    value, sep, password = value.partition(PASSWORD_SEPARATOR)
    if sep and password != PROXY_PASSWORD:
        credential = password
    task, sep, session = value.rpartition("/")
    if sep and session:
        return SessionId(session, task or None, credential)
    return SessionId(value, None, credential) if value else None


def parse_path(path: str) -> tuple[SessionId | None, str]:
    """(the ids, `/rest`) for `/t/TASK/s/SESSION/rest`; (None, path) for a path without the prefix."""
    m = PATH_PREFIX.match(path)
    if not m:
        return None, path
    task = unquote(m.group("task")) if m.group("task") else None
    return SessionId(unquote(m.group("session")), task, m.group("credential")), m.group("rest") or "/"


def decode_proxy_user(user: str) -> str:
    """A proxy user name as sent (`TASK%2FSESSION`) → its compact form (`TASK/SESSION`)."""
    return unquote(user)


def parse_proxy_user(user: str | None) -> SessionId | None:
    """The ids in a proxy user name as sent (percent-encoded); None for an empty one."""
    return parse_compact(decode_proxy_user(user)) if user else None


def parse_api_key(key: str | None) -> SessionId | None:
    """The ids in a `polar-…` (or `polarc-CRED-…`) API key; None for any other key (a real provider key names no
    session)."""
    if key and key.startswith(CREDENTIAL_KEY_PREFIX):
        rest = key[len(CREDENTIAL_KEY_PREFIX) :]
        cred, dash, compact = (
            rest[:CREDENTIAL_CHARS],
            rest[CREDENTIAL_CHARS : CREDENTIAL_CHARS + 1],
            rest[CREDENTIAL_CHARS + 1 :],
        )
        return parse_compact(compact, cred) if dash == "-" else None
    if not key or not key.startswith(API_KEY_PREFIX):
        return None
    return parse_compact(key[len(API_KEY_PREFIX) :])
