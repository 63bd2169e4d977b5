"""What the gateway's mitmproxy addons share: the running core (the options applied, what was built from them, the
calls in flight) and the answers any of them may give.

One object, handed to each addon when `addon/polar.py` composes them (`gateway_addons`), so no addon reaches into
another: `Configuration` builds the core from the options, the others read it as each flow goes by.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from mitmproxy import http

from polar_mitm.codecs import DEFAULT_CODEC
from polar_mitm.codecs.base import GatewayError, HttpAnswer
from polar_mitm.engines.client import EngineClient
from polar_mitm.gateway import control
from polar_mitm.gateway import identity as ident
from polar_mitm.gateway.addons.hop import LoopbackHop
from polar_mitm.gateway.cancel import CallCancel
from polar_mitm.gateway.options import GatewayOptions
from polar_mitm.gateway.prompts import PromptBuilder
from polar_mitm.gateway.service import Gateway
from polar_mitm.processes import secret_handover
from polar_mitm.storage.journal import RecordWriter

log = logging.getLogger(__name__)


class CallsInFlight:
    """The model calls answered inline (inside `request`, not via the live server), each with the cancel its
    connection's close, its stream's reset or shutdown sets."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._cancels: dict[str, CallCancel] = {}  # flow id → the cancel of its call (while the call runs)
        self._connections: dict[str, set[str]] = {}  # client connection id → ids of its flows in a model call

    def __len__(self) -> int:
        return len(self._tasks)

    def track(self, task: asyncio.Task) -> None:
        """Keep `task` until it is done (so shutdown can wait for it)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def begin(self, flow_id: str, connection: str, cancel: CallCancel) -> None:
        self._cancels[flow_id] = cancel
        self._connections.setdefault(connection, set()).add(flow_id)

    def end(self, flow_id: str, connection: str) -> None:
        self._cancels.pop(flow_id, None)
        flows = self._connections.get(connection)
        if flows is not None:
            flows.discard(flow_id)

    def cancel_connection(self, connection: str) -> None:
        """The client connection closed: forget it, and cancel its calls still running."""
        for flow_id in self._connections.pop(connection, set()):
            cancel = self._cancels.get(flow_id)
            if cancel is not None:
                cancel.cancel()

    def cancel_all(self, reason: str) -> None:
        for cancel in list(self._cancels.values()):
            cancel.cancel(reason)


class GatewayCore:
    """The gateway as it runs: the options applied, the service, writer, engine and prompt builder made from them,
    the calls in flight, and what each flow's early hooks left for its later ones."""

    def __init__(self) -> None:
        self.options: GatewayOptions | None = None  # the options applied (parsed and checked)
        self.gateway: Gateway | None = None
        self.writer: RecordWriter | None = None
        self.engine: EngineClient | None = None
        self.prompts: PromptBuilder | None = None
        self.is_running = False  # past startup: a bad option is refused (rolled back) rather than fatal
        self.closing = False
        self.calls = CallsInFlight()
        self.hop = LoopbackHop()  # sends live-streamed answers, which mitmproxy streams on (live_server.py)
        self.credentials: dict[str, ident.Credentials] = {}  # flow id → what requestheaders took off it
        self.proxy_users: dict[str, str] = {}  # client connection id → its proxy user (regular mode)
        self.engine_task: asyncio.Task | None = (
            None  # writes <polar_out>/_engine.json (engines/description.py)
        )
        self.control_token = control.take_token()  # None: no control call (gateway/control.py)
        # Set by a rollout that starts us: only calls with a valid session credential (session_ids.py).
        self.session_key = secret_handover.take("session_key")

    def is_control(self, flow: http.HTTPFlow) -> bool:
        """Whether `flow` is on the control path of a gateway that takes control calls."""
        return self.control_token is not None and flow.request.path.split("?", 1)[0] == control.CONTROL_PATH

    @property
    def calls_running(self) -> int:
        """Calls running inline or behind the loopback hop (live answers, deferred calls)."""
        return len(self.calls) + self.hop.busy

    async def wait_calls(self, timeout: float) -> None:
        """Until no call runs (inline or live), or `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.calls_running and loop.time() < deadline:
            await asyncio.sleep(0.05)


def error_answer(status: int, message: str) -> http.Response:
    """A provider-neutral (OpenAI-shaped) error for a request the gateway cannot hand to its codecs."""
    answer = DEFAULT_CODEC.encode_error(GatewayError("internal", message))
    return http.Response.make(status, answer.body, {"content-type": answer.content_type})


def make_response(answer: HttpAnswer) -> http.Response:
    headers_out: dict[str, Any] = {"content-type": answer.content_type, **(answer.headers or {})}
    return http.Response.make(answer.status, answer.body, headers_out)


def answer_internal_error(flow: http.HTTPFlow, exc: Exception) -> None:
    """Fail closed: a gateway bug must not let the request through to the real provider. Called in the except."""
    log.exception("unexpected error on %s %s", flow.request.method, flow.request.path)
    flow.response = error_answer(500, f"polar-mitm internal error: {exc!r}")
