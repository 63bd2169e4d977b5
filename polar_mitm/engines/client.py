"""Talks to the engine over HTTP: chat with ids, logprobs, meta info — answered whole, or streamed (`open_stream`:
SSE chunks with per-chunk logprobs and the final sglext chunk with the ids).

The client is the transport (a pooled aiohttp session, retries on a closing keep-alive connection, engine failures
as typed GatewayErrors); what differs between engine kinds is the engine's dialect (`engines/dialects/`): SGLang
and the embedded engine speak SGLang's API, which is what the gateway speaks; vLLM's calls and answers are
translated both ways, so the rest of the gateway never knows which engine answered. The dialect is asked of the
engine at the first call (`polar_engine=auto`: SGLang and `polar-mitm serve` answer `/model_info`, vLLM
`/version`) or set (one of `dialects.ENGINE_KINDS`), and its kind written into the model info (`engine_kind`, in
`_engine.json`). Every answer's meta info says whether its logprobs are temperature-scaled
(`logprobs_temperature_scaled`): SGLang's always are; vLLM's per its `--logprobs-mode`.

Every request carries the engine's API key (`engine_keys.key_for`: handed to the gateway through a pipe, or
`$POLAR_ENGINE_KEY` for a gateway started by hand). A vLLM answer is labelled with the weight version read *before*
the call; when a push changed it by the end, the answer's meta also says `weight_version_after`, and the record
keeps the older label, so the trainer counts the call as stale rather than as the new weights' (issue 36 item 11).

aiohttp rather than httpx: on this hot path it costs ~0.3 ms per call against ~0.7 ms (benchmarks/bench_gateway.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import aiohttp
import orjson

from polar_mitm.codecs.base import GatewayError
from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines.dialects import DIALECTS, ENGINE_KINDS, EngineDialect, detect
from polar_mitm.engines.dialects.base import StreamTranslator, weight_version_of

log = logging.getLogger(__name__)

# uvicorn (SGLang's server and ours) closes an idle keep-alive connection after 5 s; aiohttp would keep it 15 s, and a
# call sent on a connection the engine is closing fails with ServerDisconnectedError before the engine read it. Idle
# connections are dropped first on our side, and such a call is sent once more on a fresh connection.
KEEPALIVE_SECONDS = 4.0


class EngineStream:
    """An engine's open streamed answer; `sse_frames` reads its events in SGLang's shape whatever the engine."""

    def __init__(self, response: aiohttp.ClientResponse, translator: StreamTranslator | None = None) -> None:
        self.response = response
        self.translator = translator

    async def read(self) -> bytes:
        """The whole raw body (as the engine sent it, untranslated)."""
        return await self.response.read()

    async def frames(self) -> AsyncIterator[tuple[str | None, bytes]]:
        if self.translator is None:
            async for frame in raw_sse_frames(self.response):
                yield frame
            return
        async for event, data in raw_sse_frames(self.response):
            if data == b"[DONE]":
                break
            for chunk in self.translator.feed(orjson.loads(data)):
                yield event, orjson.dumps(chunk)
        for chunk in self.translator.finish():  # also when the engine closed without [DONE] (an abort)
            yield None, orjson.dumps(chunk)
        yield None, b"[DONE]"


class EngineClient:
    """A pooled async HTTP client to one engine, speaking its dialect; maps engine failures to typed GatewayErrors."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        max_connections: int = 512,
        kind: str = "auto",
        api_key: str | None = None,
        tool_call_parser: str = "auto",
    ) -> None:
        if kind != "auto" and kind not in DIALECTS:
            raise ValueError(f"engine kind must be auto or one of {ENGINE_KINDS}, got {kind!r}")
        self.base_url = base_url.rstrip("/")
        key = api_key or engine_keys.key_for(self.base_url)
        self._headers = {
            "content-type": "application/json",
            **({"authorization": f"Bearer {key}"} if key else {}),
        }
        self.timeout = timeout
        self.max_connections = max_connections
        self.kind_setting = kind
        self._dialect: EngineDialect | None = None if kind == "auto" else DIALECTS[kind]
        self._session: aiohttp.ClientSession | None = None
        self._served_model: str | None = None
        self._model_info: dict[str, Any] | None = None
        self.tool_call_parser = tool_call_parser  # `auto`: the engine's own (see `model_info`)
        self.streams_say_version = False  # learnt from a stream: its sglext carries the weight version

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

    async def request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        """The engine's answer to one call, raw (GatewayError: `overloaded` when it is down or timed out, else what
        its error status says)."""
        with self._unreachable_as_overloaded():
            for attempt in (1, 2):
                try:
                    async with self._client().request(
                        method, self.base_url + path, data=body, headers=self._headers
                    ) as resp:
                        raw = await resp.read()
                        status = resp.status
                    break
                except aiohttp.ServerDisconnectedError:
                    if attempt == 2:
                        raise
        if status >= 400:
            raise status_error(status, raw)
        return raw

    @contextmanager
    def _unreachable_as_overloaded(self) -> Iterator[None]:
        """A timeout or a refused/broken connection is the gateway's `overloaded` (the caller may retry elsewhere)."""
        try:
            yield
        except TimeoutError as exc:
            raise GatewayError(
                "overloaded", f"the engine at {self.base_url} timed out after {self.timeout}s"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise GatewayError(
                "overloaded", f"the engine at {self.base_url} is unreachable: {exc!r}"
            ) from exc

    async def get_json(self, path: str) -> Any:
        raw = await self.request("GET", path)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise GatewayError(
                "engine_error", f"the engine's {path} answer is not JSON: {raw[:200]!r}"
            ) from exc

    async def dialect(self) -> EngineDialect:
        """The engine's dialect: as set, or asked of the engine once (GatewayError while it is down)."""
        if self._dialect is None:
            self._dialect = await detect(self)
        return self._dialect

    async def kind(self) -> str:
        """One of `ENGINE_KINDS`: the engine's dialect's."""
        return (await self.dialect()).kind

    async def model_info(self) -> dict[str, Any]:
        """The engine's description in SGLang's `/model_info` names (model and tokenizer paths, EOS ids, version),
        with `engine_kind`; vLLM's is assembled from its own endpoints."""
        if self._model_info is None:
            dialect = await self.dialect()
            info = {**await dialect.read_model_info(self), "engine_kind": dialect.kind}
            if self.tool_call_parser != "auto":  # polar_tool_call_parser: what vLLM's raw text is parsed with
                info["tool_call_parser"] = self.tool_call_parser
            self._model_info = info
        return self._model_info

    async def weight_version(self) -> str | None:
        """The engine's current weight version, asked now (streamed chunks do not carry it)."""
        dialect = await self.dialect()
        try:
            raw = await self.request("GET", dialect.weight_version_path)
        except GatewayError as err:
            if err.kind == "overloaded" or not dialect.versionless:
                raise
            return None  # an engine of a kind that may have no versions (vLLM without dev mode)
        try:
            return weight_version_of(orjson.loads(raw))
        except ValueError:
            return None

    @asynccontextmanager
    async def open_stream(self, body: bytes) -> AsyncIterator[EngineStream]:
        """POST a `stream: true` chat body; the open stream once the engine accepted it (in SGLang's shape: the
        dialect's translator reads it where the engine speaks another).

        Leaving the context early closes the connection, which SGLang, vLLM and `polar-mitm serve` take as an abort.
        """
        path, body, translator = await (await self.dialect()).stream_call(self, body)
        with self._unreachable_as_overloaded():
            try:
                resp = await self._client().post(self.base_url + path, data=body, headers=self._headers)
            except (
                aiohttp.ServerDisconnectedError
            ):  # a closing keep-alive connection: once more on a fresh one
                resp = await self._client().post(self.base_url + path, data=body, headers=self._headers)
        try:
            if resp.status >= 400:
                raise status_error(resp.status, await resp.read())
            yield EngineStream(resp, translator)
        finally:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()

    async def abort_request(self, rid: str) -> None:
        """Stop generating `rid` (a streamed call then ends with finish `abort`): the dialect's abort call (SGLang's
        `POST /abort_request`, vLLM's `POST /abort_requests`)."""
        path, payload = (await self.dialect()).abort_call(rid)
        await self.request("POST", path, orjson.dumps(payload))

    async def chat(self, body: bytes) -> bytes:
        """A chat call answered whole; returns SGLang's answer as raw JSON bytes (parsed off the loop by the caller)."""
        return await (await self.dialect()).chat(self, body)

    async def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        payload: dict[str, Any] = {"messages": messages, "add_generation_prompt": False}
        if tools:
            payload["tools"] = tools
        raw = await self.request("POST", "/tokenize", orjson.dumps(payload))
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

    async def served_model(self) -> str:
        if self._served_model is None:
            raw = await self.request("GET", "/v1/models")
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


async def sse_frames(stream: EngineStream) -> AsyncIterator[tuple[str | None, bytes]]:
    """(event name, data) of each event of an engine stream, in SGLang's shape (vLLM's translated)."""
    async for frame in stream.frames():
        yield frame


async def raw_sse_frames(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str | None, bytes]]:
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
