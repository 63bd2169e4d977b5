"""The judge's HTTP client: any OpenAI-compatible chat-completions endpoint, asked at temperature 0.

Why a client of its own rather than the run's: a judge call must never pass a gateway of the run (it would be
recorded, and could be trained on), so it goes straight to `--judge-url` with proxies from the environment ignored.
Attempts are bounded by a timeout each and retried with exponential backoff (tenacity) on what a retry can cure:
a connection that failed, a 429 or a 5xx. The API key comes from an environment variable and is only ever a
request header.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

log = logging.getLogger(__name__)


class JudgeUnavailable(RuntimeError):
    """The judge gave no answer: down, timing out, or refusing the request (after the retries)."""


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code == 429 or exc.response.status_code >= 500
    return isinstance(exc, httpx.TransportError)


class JudgeClient:
    """Chat completions at `base_url` (…/v1), at most `concurrency` at once."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None,
        timeout: float,
        attempts: int,
        concurrency: int,
        backoff_max: float = 8.0,
    ) -> None:
        self.model, self.attempts, self.backoff_max = model, attempts, backoff_max
        self.url = base_url.rstrip("/") + "/chat/completions"
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=timeout, headers=headers, trust_env=False)
        self.slots = asyncio.Semaphore(concurrency)
        self.calls = 0  # HTTP attempts made, for the counts

    async def __aenter__(self) -> JudgeClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.http.aclose()

    async def complete(self, messages: list[dict[str, str]]) -> str:
        """The judge's answer text; JudgeUnavailable when every attempt failed."""
        body = {"model": self.model, "messages": messages, "temperature": 0}
        try:
            async with self.slots:
                async for attempt in AsyncRetrying(
                    stop=stop_after_attempt(self.attempts),
                    wait=wait_exponential(multiplier=0.5, max=self.backoff_max),
                    retry=retry_if_exception(_retryable),
                    reraise=True,
                ):
                    with attempt:
                        return await self._post(body)
        except (httpx.HTTPError, ValueError) as exc:
            raise JudgeUnavailable(f"judge at {self.url}: {type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable: tenacity either returns or re-raises")

    async def _post(self, body: dict[str, Any]) -> str:
        self.calls += 1
        response = await self.http.post(self.url, json=body)
        response.raise_for_status()
        try:
            content = response.json()["choices"][0]["message"].get("content")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a chat completion ({type(exc).__name__}: {exc})") from None
        if not isinstance(content, str):
            raise ValueError("the answer has no message content")
        return content
