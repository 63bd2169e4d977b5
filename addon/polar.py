"""mitmproxy entry point: `mitmdump -s addon/polar.py [--set polar_backend=URL --set polar_out=DIR ...]`.

Thin on purpose: the logic lives in the `polar_mitm` package (`polar_mitm/gateway/`).
"""

from polar_mitm.gateway.mitm_addon import PolarGateway

addons = [PolarGateway()]
