"""mitmproxy entry point: `mitmdump -s addon/polar.py [--set polar_backend=URL --set polar_out=DIR ...]`.

Thin on purpose: the addons live in the `polar_mitm` package (`polar_mitm/gateway/addons/`, one concern each).
"""

from polar_mitm.gateway.addons import gateway_addons

addons = gateway_addons()
