"""Engine API keys: every engine we start gets one, and only the gateway, the loop and the trainer's push hold it.

Why: an unauthenticated engine lets any process of the host sample unrecorded, abort other sessions' calls, or push
its own weights under the served version label (issue 36 item 2). Where a key lives:

- the process that started an engine (`engines.processes.start_engine`, `vllm.server.start_vllm`) remembers it
  per engine URL (`remember`, `key_for`), so the loop's pushes and the gateways it starts find it without
  passing it around;
- a child that needs it (the engine itself, a gateway, a trainer process) gets it through an inherited pipe
  (`secret_handover`, name `engine_key`), never its command line or environment: `process_key` reads it;
- a user who runs a gateway, `grpo --push-to-engine` or `polar-mitm sync` by hand against an engine with a key
  names a key file in `POLAR_ENGINE_KEY_FILE` (mode 600), or sets `POLAR_ENGINE_KEY` itself (popped at the first
  read; weaker: `/proc/PID/environ` keeps the exec-time block, readable by every process of the user).

`KeyGuard` is the server's side: a pure ASGI middleware (standard library only, so vLLM's venv loads it through
`--middleware`) that answers 401 to every request without `Authorization: Bearer KEY`, except `/health` (readiness
polls). An engine started without a key serves sampling routes only; its admin routes answer 403.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from polar_mitm.processes import secret_handover

log = logging.getLogger(__name__)

KEY_ENV = "POLAR_ENGINE_KEY"
KEY_FILE_ENV = (
    "POLAR_ENGINE_KEY_FILE"  # a file holding it (mode 600): the key itself stays out of the environment
)
HANDOVER_NAME = "engine_key"
OPEN_PATHS = frozenset({"/health"})  # readiness polls need no key
# Without a key an engine still samples (a local dev engine, as SGLang without --api-key); nothing else.
KEYLESS_PATHS = frozenset(
    {"/health_generate", "/version", "/model_info", "/get_model_info", "/tokenize", "/generate", "/v1/models"}
)
KEYLESS_PREFIXES = ("/v1/chat/", "/v1/completions")

_by_url: dict[str, str] = {}
_own: list[str | None] = []  # this process's key, once read (a list: "not read yet" differs from "none")


class KeyFileError(ValueError):
    """A key file that cannot be used; its message is the one line the user sees."""


def new_key() -> str:
    return secrets.token_urlsafe(32)


def _normalised(url: str) -> str:
    return url.strip().rstrip("/")


def remember(url: str, key: str) -> None:
    """This process started the engine at `url` with `key`."""
    _by_url[_normalised(url)] = key


def forget(url: str) -> None:
    _by_url.pop(_normalised(url), None)


def process_key() -> str | None:
    """The key this process was given: handed over by its parent, else `$POLAR_ENGINE_KEY` (popped), else the file
    `$POLAR_ENGINE_KEY_FILE` names (KeyFileError when that file cannot be used)."""
    if not _own:
        env_key = (os.environ.pop(KEY_ENV, None) or "").strip() or None
        key = secret_handover.take(HANDOVER_NAME) or env_key
        key_file = os.environ.get(KEY_FILE_ENV)
        if key is None and key_file:
            key = read_key_file(Path(key_file), option=f"${KEY_FILE_ENV}")
        _own.append(key)
    return _own[0]


def key_for(url: str | None) -> str | None:
    """The key of the engine at `url`: the one we started it with, else this process's own."""
    if url is not None:
        known = _by_url.get(_normalised(url))
        if known is not None:
            return known
    return process_key()


def auth_headers(url: str | None) -> dict[str, str]:
    """The `Authorization` header a call to the engine at `url` carries (none when no key is known)."""
    key = key_for(url)
    return {"Authorization": f"Bearer {key}"} if key else {}


def read_key_file(path: Path, *, option: str = "--api-key-file") -> str:
    """The key in `path` (one line); KeyFileError with what to do when it is missing, empty or readable by others."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise KeyFileError(f"{option} {path}: cannot read it ({exc.strerror})") from exc
    if mode & 0o077:
        raise KeyFileError(f"{option} {path}: readable by others; run `chmod 600 {path}`")
    if not text or "\n" in text or len(text) < 16:
        raise KeyFileError(f"{option} {path}: must hold one key of at least 16 characters on one line")
    return text


def header_matches(authorization: bytes | None, key: str) -> bool:
    """Does an `Authorization` header value carry `Bearer KEY`? (constant time)"""
    if not authorization:
        return False
    scheme, _, given = authorization.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class KeyGuard:
    """ASGI middleware: `key` required on every path but `/health`; without a key, sampling routes only."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app, self.key = app, key

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, message) when this request must be refused, None when it may pass."""
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        if scope.get("type") not in ("http", "websocket") or path in OPEN_PATHS:
            return None
        if self.key is None:
            if path in KEYLESS_PATHS or path.startswith(KEYLESS_PREFIXES):
                return None
            return 403, f"{path} is off: this engine was started without an API key (--api-key-file)"
        headers = dict(scope.get("headers") or [])
        if header_matches(headers.get(b"authorization"), self.key):
            return None
        return 401, "missing or wrong engine API key: send `Authorization: Bearer KEY`"

    async def __call__(self, scope: Scope, receive, send) -> None:
        refused = self.refusal(scope)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, message = refused
        if scope.get("type") == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            {"object": "error", "message": message, "type": "AuthenticationError", "code": status}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class ProcessKeyGuard(KeyGuard):
    """`KeyGuard` with this process's key: what vLLM loads through `--middleware` (it passes no arguments)."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__(app, process_key())


def handover_across_exec(key: str | None, env: dict[str, str]) -> dict[str, str]:
    """The environment for an `os.execve` that keeps `key` readable by the new program (`process_key`): the pipe's
    read end stays open and inheritable across the exec; only its number is in the environment."""
    handover = secret_handover.Handover({HANDOVER_NAME: key})
    kwargs = handover.popen_kwargs({k: v for k, v in env.items() if k != KEY_ENV})
    for fd in kwargs["pass_fds"]:
        os.set_inheritable(fd, True)
    return kwargs["env"]
