"""The control path, `POST /_polar/control` (gateway/control.py is its logic): checked at its headers, answered in
`request` once the calls still running have ended.

Only a gateway started with a control token has a control path (`GatewayCore.is_control`); without the token in
`x-polar-control-token` the call is refused at its headers, whatever its body. A control call is never forwarded
upstream nor recorded: `ModelCalls`, after this addon, leaves it alone.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from mitmproxy import ctx, http
from mitmproxy.exceptions import OptionsError

from polar_mitm.codecs.base import HttpAnswer
from polar_mitm.gateway import control
from polar_mitm.gateway.addons.core import GatewayCore, answer_internal_error, make_response

log = logging.getLogger(__name__)


class ControlCalls:
    """Checks a control call's token before any body limit, then applies its options between calls."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        """A control call with the token is left whole to `request`, whatever the body limit; without it, it is
        refused now."""
        if self.core.hop.holds(flow) or not self.core.is_control(flow):
            return  # refused at its head already, or not a control call
        given = flow.request.headers.pop(control.TOKEN_HEADER, "")
        if flow.request.method == "POST" and control.authorized(self.core.control_token, given):
            flow.metadata["polar_control"] = True  # `request` answers it, with its whole body
            return
        del self.core.credentials[flow.id]
        await self.core.hop.refuse_at_headers(flow, control.control_refused())

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or self.core.hop.holds(flow) or not self.core.is_control(flow):
            return
        try:
            flow.response = await self._answer(flow)
        except Exception as exc:
            answer_internal_error(flow, exc)

    async def _answer(self, flow: http.HTTPFlow) -> http.Response:
        flow.request.headers.pop(control.TOKEN_HEADER, None)
        if not flow.metadata.get("polar_control"):
            return make_response(control.control_refused())
        return make_response(await control_answer(self.core, flow.request.raw_content or b""))


async def control_answer(core: GatewayCore, body: bytes) -> HttpAnswer:
    """Once the calls still running have ended, apply the options (a new records folder: the old journal is
    compacted into shards before this answers). The token was checked at the headers; the base-URL server
    (gateway/base_url_server.py) answers its control calls here too."""
    try:
        texts = control.option_texts(body)
    except ValueError as exc:
        return control.refused(400, f"polar-mitm: control call: {exc}")
    refusal = control.refusal(texts, core.options) if core.options is not None else None
    if refusal is not None:
        return control.refused(403, f"polar-mitm: control call refused: {refusal}")
    await core.wait_calls(control.DRAIN_SECONDS)
    if core.calls_running:
        return control.refused(409, "polar-mitm: calls are still running; nothing changed")
    try:
        # mitmproxy's parser, then configure (refused: rolled back, nothing changed)
        ctx.options.set(*texts)
    except OptionsError as exc:
        return control.refused(400, f"polar-mitm: control call: {exc}")
    if core.engine_task is not None:  # the new folder's _engine.json, before the caller sends calls there
        written = asyncio.ensure_future(asyncio.shield(core.engine_task))
        done, _ = await asyncio.wait({written}, timeout=30)
        if not done:
            log.warning("the engine description for %s is not written yet", core.options.out)
    body = {"out": core.options.out if core.options else None, "applied": texts}
    return HttpAnswer(200, orjson.dumps(body), "application/json")
