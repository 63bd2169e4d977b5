"""What mitmproxy keeps of a flow (its `-w` files, its logs) holds no secret and no hop: the last of a flow's hooks.

A flow sent to the loopback hop gets back the request the harness sent (its body too, where the hop was sent none),
and its record in its metadata, as for answers sent whole; credentials taken at the headers are forgotten, and a flow
that failed is scrubbed of any still on it.
"""

from __future__ import annotations

from mitmproxy import http

from polar_mitm.gateway import identity as ident
from polar_mitm.gateway.addons.core import GatewayCore


class FlowFiles:
    """Streams live answers on, and puts each flow back as the harness sent it once its answer is in or lost."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """A live answer's body is streamed to the harness chunk by chunk, as the live server writes it."""
        if self.core.hop.holds(flow):
            flow.response.stream = True

    def response(self, flow: http.HTTPFlow) -> None:
        self.core.credentials.pop(flow.id, None)
        answer = self.core.hop.take_back(flow)
        if answer is not None and answer.row is not None:  # kept in `-w` files, as for answers sent whole
            flow.metadata["polar_record"] = answer.row

    def error(self, flow: http.HTTPFlow) -> None:
        """A live flow that failed before its answer was fetched still gets its call run (and recorded)."""
        self.core.credentials.pop(flow.id, None)
        ident.scrub_credentials(flow.request.headers, flow.request.query)
        self.core.hop.abandon(flow)
