"""Talks to the engine (SGLang or the embedded one) over HTTP: chat with ids, logprobs, meta info — answered whole,
or streamed (`open_stream`: SSE chunks with per-chunk logprobs and the final sglext chunk with the ids).

aiohttp rather than httpx: on this hot path it costs ~0.3 ms per call against ~0.7 ms (benchmarks/bench_gateway.py).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson

from polar_mitm.codecs.base import GatewayError
from polar_mitm.engines import weight_version_of

# uvicorn (SGLang's server and ours) closes an idle keep-alive connection after 5 s; aiohttp would keep it 15 s, and a
# call sent on a connection the engine is closing fails with ServerDisconnectedError before the engine read it. Idle
# connections are dropped first on our side, and such a call is sent once more on a fresh connection.
KEEPALIVE_SECONDS = 4.0


class EngineClient:
    """A pooled async HTTP client; maps engine failures to typed GatewayErrors."""

    def __init__(self, base_url: str, *, timeout: float = 600.0, max_connections: int = 512) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._served_model: str | None = None
        self._model_info: dict[str, Any] | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created lazily: an aiohttp session belongs to the event loop that first uses it.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections, ttl_dns_cache=300, keepalive_timeout=KEEPALIVE_SECONDS
                ),
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=5.0),
                trust_env=False,  # never route engine traffic through the harness's HTTPS_PROXY (ourselves)
                json_serialize=lambda obj: orjson.dumps(obj).decode(),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        try:
            for attempt in (1, 2):
                try:
                    async with self._client().request(
                        method, self.base_url + path, data=body, headers={"content-type": "application/json"}
                    ) as resp:
                        raw = await resp.read()
                        status = resp.status
                    break
                except aiohttp.ServerDisconnectedError:
                    if attempt == 2:
                        raise
        except TimeoutError as exc:
            raise GatewayError(
                "overloaded", f"the engine at {self.base_url} timed out after {self.timeout}s"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise GatewayError(
                "overloaded", f"the engine at {self.base_url} is unreachable: {exc!r}"
            ) from exc
        if status >= 400:
            raise status_error(status, raw)
        return raw

    @asynccontextmanager
    async def open_stream(self, body: bytes) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST /v1/chat/completions (a `stream: true` body); the open response once the engine accepted it.

        Leaving the context early closes the connection, which SGLang and `polar-mitm serve` both take as an abort.
        """
        try:
            try:
                resp = await self._client().post(
                    self.base_url + "/v1/chat/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                )
            except (
                aiohttp.ServerDisconnectedError
            ):  # a closing keep-alive connection: once more on a fresh one
                resp = await self._client().post(
                    self.base_url + "/v1/chat/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                )
        except TimeoutError as exc:
            raise GatewayError(
                "overloaded", f"the engine at {self.base_url} timed out after {self.timeout}s"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise GatewayError(
                "overloaded", f"the engine at {self.base_url} is unreachable: {exc!r}"
            ) from exc
        try:
            if resp.status >= 400:
                raise status_error(resp.status, await resp.read())
            yield resp
        finally:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()

    async def abort_request(self, rid: str) -> None:
        """SGLang's `POST /abort_request`: stop generating `rid` (a streamed call then ends with finish `abort`)."""
        await self._request("POST", "/abort_request", orjson.dumps({"rid": rid}))

    async def weight_version(self) -> str | None:
        """The engine's current weight version, asked now (SGLang's streamed chunks do not carry it)."""
        raw = await self._request("GET", "/model_info")
        try:
            return weight_version_of(orjson.loads(raw))
        except ValueError:
            return None

    async def chat(self, body: bytes) -> bytes:
        """POST /v1/chat/completions; returns the raw JSON bytes (parsed off the event loop by the caller)."""
        return await self._request("POST", "/v1/chat/completions", body)

    async def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        payload: dict[str, Any] = {"messages": messages, "add_generation_prompt": False}
        if tools:
            payload["tools"] = tools
        raw = await self._request("POST", "/tokenize", orjson.dumps(payload))
        try:
            count = orjson.loads(raw)["count"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise GatewayError(
                "engine_error", f"the engine's /tokenize answer has no count: {raw[:200]!r}"
            ) from exc
        if type(count) is not int or count < 0:
            raise GatewayError(
                "engine_error", f"the engine's /tokenize count is not a token count: {count!r}"
            )
        return count

    async def model_info(self) -> dict[str, Any]:
        """GET /model_info (SGLang and the embedded engine): model and tokenizer paths, EOS ids, versions."""
        if self._model_info is None:
            try:
                raw = await self._request("GET", "/model_info")
            except GatewayError:  # SGLang's router serves only the older name
                raw = await self._request("GET", "/get_model_info")
            info = orjson.loads(raw)
            if not isinstance(info, dict):
                raise GatewayError("engine_error", f"unexpected /model_info answer: {raw[:200]!r}")
            self._model_info = info
        return self._model_info

    async def served_model(self) -> str:
        if self._served_model is None:
            raw = await self._request("GET", "/v1/models")
            try:
                served = orjson.loads(raw)["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise GatewayError("engine_error", f"unexpected /v1/models answer: {raw[:200]!r}") from exc
            if not isinstance(served, str):
                raise GatewayError("engine_error", f"unexpected /v1/models answer: {raw[:200]!r}")
            self._served_model = served
        return self._served_model


def status_error(status: int, raw: bytes) -> GatewayError:
    """The typed error of an engine answer with HTTP status >= 400."""
    if status >= 500:
        return GatewayError(
            "engine_error", f"the engine failed with HTTP {status}: {raw[:500].decode('utf-8', 'replace')}"
        )
    message = engine_error_message(raw)
    lowered = message.lower()
    kind = (
        "context_length"
        if ("context length" in lowered or "longer than" in lowered or "exceeds the maximum" in lowered)
        else "invalid_request"
    )
    counts = OVERFLOW_COUNTS.search(message) if kind == "context_length" else None
    tokens = (int(counts.group(1)), int(counts.group(2))) if counts else None
    return GatewayError(kind, message, tokens=tokens)


# SGLang and `polar-mitm serve`: "The input (N tokens) is longer than the model's context length (M tokens)."
OVERFLOW_COUNTS = re.compile(r"\((\d+) tokens\).*?\((\d+) tokens\)", re.DOTALL)


async def sse_frames(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str | None, bytes]]:
    """(event name, data) of each Server-Sent Event of `resp`; comments and empty frames are skipped.

    Read in raw chunks rather than lines: the final sglext frame of a long prompt is far longer than aiohttp's
    line limit.
    """
    buffer = bytearray()
    async for data in resp.content.iter_any():
        buffer += data.replace(b"\r\n", b"\n") if b"\r" in data else data
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            frame = parse_frame(bytes(buffer[start:end]))
            start = end + 2
            if frame is not None:
                yield frame
        del buffer[:start]
    frame = parse_frame(bytes(buffer))
    if frame is not None:
        yield frame


def parse_frame(frame: bytes) -> tuple[str | None, bytes] | None:
    """One SSE frame → (event name, data lines joined); None for comments and empty frames."""
    event: str | None = None
    data: list[bytes] = []
    for line in frame.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
        elif line.startswith(b"event:"):
            event = line[6:].strip().decode("utf-8", "replace")
    if not data:
        return None
    return event, b"\n".join(data)


def engine_error_message(raw: bytes) -> str:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")[:500]
    if isinstance(data, dict):
        if isinstance(data.get("message"), str):
            return data["message"]
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
    return str(data)[:500]
