"""The gateway's control call: a runner that keeps one gateway across its rollouts (the RL loop) points it at the
next records folder and sampling options with `POST /_polar/control`, instead of starting a new gateway (2–3 s, the
tokenizer loaded again) for each.

Only the process that started the gateway can make it: the gateway reads a token from the pipe it inherited as it
starts (`polar_mitm.processes.secret_handover`: never in its environment or command line, which any process of
the same user can read), and the call must carry it in `x-polar-control-token`. Without a token the path is
nothing special (answered as any request that is not a model call). A control call is never forwarded upstream
nor recorded, and changes only `polar_` options.

Even with the token, a call that would weaken the gateway (open passthrough, turn fsync off) or move its records
folder is refused unless the gateway was started allowing it (`polar_control_may_weaken`,
`polar_control_may_move_out`); those two are set at start only, never through a control call.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

import orjson

from polar_mitm.codecs import DEFAULT_CODEC
from polar_mitm.codecs.base import GatewayError, HttpAnswer
from polar_mitm.gateway.options import PREFIX, STARTUP_ONLY, GatewayOptions
from polar_mitm.processes import secret_handover

CONTROL_PATH = "/_polar/control"
TOKEN_HEADER = "x-polar-control-token"
DRAIN_SECONDS = 30.0  # a switch waits this long for calls still running (their records go to the old folder)


def take_token() -> str | None:
    """The control token this gateway was started with (None: no control call is accepted)."""
    return secret_handover.take("control_token")


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


def refusal(texts: list[str], current: GatewayOptions) -> str | None:
    """Why the gateway started with `current` refuses these `--set` texts from a control call; None: it may apply
    them (their values are checked when they are applied)."""
    for text in texts:
        name, _, value = text.partition("=")
        if name.removeprefix(PREFIX) in STARTUP_ONLY:
            return f"{name} is set when the gateway starts, never through a control call"
        weakens = (name == PREFIX + "passthrough" and value != "block") or (
            name == PREFIX + "fsync" and value not in ("", "true")  # mitmproxy also reads "toggle"
        )
        if weakens and not current.control_may_weaken:
            return (
                f"{text} would weaken the gateway (passthrough open or fsync off); start it with "
                f"{PREFIX}control_may_weaken=true to allow that"
            )
        if (
            name == PREFIX + "out"
            and not current.control_may_move_out
            and not _same_folder(value, current.out)
        ):
            return (
                f"{name} cannot be moved through a control call; start the gateway with "
                f"{PREFIX}control_may_move_out=true to allow that"
            )
    return None


def _same_folder(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, ValueError):  # not a path the writer could open: refused as a move
        return False


def refused(status: int, message: str) -> HttpAnswer:
    """A control call's refusal (or any answer no codec was chosen for): OpenAI-shaped, with `status`."""
    answer = DEFAULT_CODEC.encode_error(GatewayError("internal", message))
    answer.status = status
    return answer


def control_refused() -> HttpAnswer:
    """A control call without the token: the same answer whatever is wrong (nothing for a guesser to learn)."""
    return refused(403, "polar-mitm: control call refused")
