"""The gateway's engine client against an engine that drops a keep-alive connection as the next call arrives.

uvicorn (SGLang's server and `polar-mitm serve`) closes idle keep-alive connections after 5 s; a call sent on such a
connection fails before the engine read it. Seen in the suite as a 529 "Server disconnected" on the first model call
after the gateway's /model_info probe. The client must send that call again on a fresh connection.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from polar_mitm.engines.client import EngineClient

ANSWER = orjson.dumps({"ok": True})


async def _engine_that_drops_reused_connections():
    """A real TCP server: answers the first request on each connection with keep-alive, then closes the connection
    without answering when a second request arrives on it (the race with an idle timeout, made deterministic)."""
    seen = {"connections": 0, "answered": 0, "dropped": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        requests = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                requests += 1
                if requests > 1:
                    seen["dropped"] += 1
                    writer.close()
                    return
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: keep-alive\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
                )
                await writer.drain()
                seen["answered"] += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


@pytest.mark.parametrize("call", ["chat", "stream"])
def test_a_call_on_a_connection_the_engine_is_closing_is_sent_again(call):
    async def scenario():
        server, url, seen = await _engine_that_drops_reused_connections()
        client = EngineClient(url, kind="sglang")  # a stand-in for SGLang: no kind detection call
        try:
            assert orjson.loads(await client.chat(b"{}")) == {
                "ok": True
            }  # leaves a pooled keep-alive connection
            if call == "chat":
                second = orjson.loads(await client.chat(b"{}"))
            else:
                async with client.open_stream(b"{}") as resp:
                    second = orjson.loads(await resp.read())
        finally:
            await client.aclose()
            server.close()
        return second, seen

    second, seen = asyncio.run(scenario())
    assert second == {"ok": True}
    assert seen == {"connections": 2, "answered": 2, "dropped": 1}
