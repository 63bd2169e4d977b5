"""`python -m polar_mitm.gateway.launch [mitmdump arguments]`: mitmdump on uvloop's event loop.

Most of a gateway's CPU per call is mitmproxy's and asyncio's own (benchmarks/bench_gateway.py: a bare mitmdump
spends 2.2–3.5 ms per forwarded call on this machine), and it sets how many calls one process serves. On uvloop,
with both loops measured side by side in one run (sessions interleaved), a bare mitmdump spent 0.30–0.35 ms less
CPU per call and the gateway in tokens mode 0.30 ms less (1k and 8k tokens; 4–10 %). `polar-mitm` starts its
gateways this way; `mitmdump -s addon/polar.py` still works as is, on asyncio's loop.
`POLAR_EVENT_LOOP=asyncio` opts out (to tell a loop problem from ours).
"""

from __future__ import annotations

import asyncio
import os
import sys


def main() -> int | None:
    if os.environ.get("POLAR_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:  # not installed (the capture extra has it): asyncio's loop, as plain mitmdump
            pass
        else:
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    from mitmproxy.tools.main import mitmdump

    sys.argv[0] = "mitmdump"
    return mitmdump()


if __name__ == "__main__":
    sys.exit(main())
