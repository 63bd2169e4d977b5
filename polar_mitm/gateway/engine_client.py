"""Talks to the engine (SGLang or the embedded one) over HTTP: non-streaming chat with ids, logprobs, meta info."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from polar_mitm.codecs.base import GatewayError


class EngineClient:
    """An async HTTP client with a connection pool; maps engine failures to typed GatewayErrors."""

    def __init__(self, base_url: str, *, timeout: float = 600.0, max_connections: int = 512) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64),
            trust_env=False,  # never send engine traffic through the harness's HTTPS_PROXY (i.e. ourselves)
        )
        self._served_model: str | None = None

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _post(self, path: str, body: bytes) -> bytes:
        try:
            resp = await self._client.post(path, content=body, headers={"content-type": "application/json"})
        except httpx.TimeoutException as exc:
            raise GatewayError("overloaded", f"the engine at {self.base_url} timed out: {exc!r}") from exc
        except httpx.TransportError as exc:
            raise GatewayError("overloaded", f"the engine at {self.base_url} is unreachable: {exc!r}") from exc
        if resp.status_code >= 500:
            raise GatewayError("engine_error", f"the engine failed with HTTP {resp.status_code}: "
                                               f"{resp.text[:500]}")
        if resp.status_code >= 400:
            message = engine_error_message(resp.content)
            lowered = message.lower()
            kind = "context_length" if ("context length" in lowered or "longer than" in lowered
                                        or "exceeds the maximum" in lowered) else "invalid_request"
            raise GatewayError(kind, message)
        return resp.content

    async def chat(self, body: bytes) -> bytes:
        """POST /v1/chat/completions; returns the raw JSON bytes (parsed off the event loop by the caller)."""
        return await self._post("/v1/chat/completions", body)

    async def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        payload = {"messages": messages, "add_generation_prompt": False}
        if tools:
            payload["tools"] = tools
        raw = await self._post("/tokenize", orjson.dumps(payload))
        return int(orjson.loads(raw)["count"])

    async def served_model(self) -> str:
        if self._served_model is None:
            try:
                resp = await self._client.get("/v1/models")
                self._served_model = resp.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                raise GatewayError("overloaded", f"the engine at {self.base_url} is unreachable: {exc!r}") from exc
        return self._served_model


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
