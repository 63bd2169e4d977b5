"""httpx calls that carry the engine's API key: for tests that talk to an engine we started directly (every route
but /health needs it, polar_mitm/engines/keys.py)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx

from polar_mitm.engines import keys as engine_keys


def headers_for(url: str, given: dict[str, str] | None = None) -> dict[str, str]:
    parts = urlsplit(url)
    return {**engine_keys.auth_headers(f"{parts.scheme}://{parts.netloc}"), **(given or {})}


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, headers=headers_for(url, kwargs.pop("headers", None)), **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, headers=headers_for(url, kwargs.pop("headers", None)), **kwargs)


def stream(method: str, url: str, **kwargs: Any):
    return httpx.stream(method, url, headers=headers_for(url, kwargs.pop("headers", None)), **kwargs)
