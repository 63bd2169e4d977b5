"""The gateway's control call: a runner that keeps one gateway across its rollouts (the RL loop) points it at the
next records folder and sampling options with `POST /_polar/control`, instead of starting a new gateway (2–3 s, the
tokenizer loaded again) for each.

Only the process that started the gateway can make it: the gateway takes a token from `POLAR_CONTROL_TOKEN` as it
starts (and removes it from its environment, so nothing it starts inherits it), and the call must carry it in
`x-polar-control-token`. Without the variable the path is nothing special (answered as any request that is not a
model call). A control call is never forwarded upstream nor recorded, and changes only `polar_` options.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

import orjson

from polar_mitm.gateway.options import PREFIX

CONTROL_PATH = "/_polar/control"
TOKEN_ENV = "POLAR_CONTROL_TOKEN"
TOKEN_HEADER = "x-polar-control-token"
DRAIN_SECONDS = 30.0  # a switch waits this long for calls still running (their records go to the old folder)


def take_token() -> str | None:
    """The control token this gateway was started with (None: no control call is accepted)."""
    return os.environ.pop(TOKEN_ENV, None) or None


def authorized(token: str | None, given: str) -> bool:
    return token is not None and hmac.compare_digest(given.encode(), token.encode())


def option_texts(body: bytes) -> list[str]:
    """`{"options": {"polar_out": "...", ...}}` → `["polar_out=...", ...]` (mitmproxy's `--set` texts); ValueError
    with what is wrong."""
    try:
        request: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"the body is not JSON: {exc}") from exc
    options = request.get("options") if isinstance(request, dict) else None
    if not isinstance(options, dict) or not options:
        raise ValueError('the body must be {"options": {"polar_…": value, …}}')
    texts = []
    for name, value in options.items():
        if not name.startswith(PREFIX):
            raise ValueError(f"{name}: only the gateway's own ({PREFIX}…) options can be changed")
        if isinstance(value, bool):
            value = "true" if value else "false"
        if not isinstance(value, str | int | float):
            raise ValueError(f"{name}: a value must be text, a number or a boolean")
        texts.append(f"{name}={value}")
    return texts
