"""The gateway as mitmproxy addons, one concern each, composed by `addon/polar.py`.

mitmproxy runs each hook on the addons in list order, so the list reads like a flow's life: the options and the
running core they build, who is calling (refusals at the headers, credentials taken), the control path, model
calls, what flow files keep, shutdown, and the base-URL server (started with mitmproxy, closed last). An addon skips a flow an earlier one answered (a response set, a flow
sent to the loopback hop, a control call); the addons share one `GatewayCore` rather than reaching into each other.
"""

from __future__ import annotations

from polar_mitm.gateway.addons.admission import Admission
from polar_mitm.gateway.addons.base_url_calls import BaseUrlCalls
from polar_mitm.gateway.addons.configuration import Configuration
from polar_mitm.gateway.addons.control_calls import ControlCalls
from polar_mitm.gateway.addons.core import GatewayCore
from polar_mitm.gateway.addons.flow_files import FlowFiles
from polar_mitm.gateway.addons.model_calls import ModelCalls
from polar_mitm.gateway.addons.shutdown import Shutdown


def gateway_addons(core: GatewayCore | None = None) -> list[object]:
    """The gateway's addons in the order mitmproxy must run them, sharing `core` (a new one by default)."""
    core = core if core is not None else GatewayCore()
    return [
        Configuration(core),
        Admission(core),
        ControlCalls(core),
        ModelCalls(core),
        FlowFiles(core),
        Shutdown(core),
        BaseUrlCalls(core),  # its server closes once Shutdown has waited for the calls in flight
    ]
