"""The live server behind streamed answers starts once, and no caller goes on before it listens.

A fresh gateway's first wave of streamed calls arrives together (a rollout starts G sessions at once); a caller that
saw the server "starting" and went on with port 0 had its flow answered 502 by mitmproxy (a crashed session).
"""

from __future__ import annotations

import asyncio

import aiohttp

from polar_mitm.gateway.live_server import LiveServer


def test_concurrent_first_starts_all_wait_for_the_listening_port():
    async def scenario() -> list[int]:
        server = LiveServer()

        async def start_then_port() -> int:
            await server.start()
            return server.port

        ports = await asyncio.gather(*(start_then_port() for _ in range(4)))
        async with aiohttp.ClientSession() as http:  # it really listens there
            async with http.get(f"http://127.0.0.1:{ports[0]}/nothing") as response:
                assert response.status in (404, 410)
        await server.close()
        return ports

    ports = asyncio.run(scenario())
    assert len(set(ports)) == 1 and ports[0] > 0
