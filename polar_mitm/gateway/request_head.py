"""A request's head checked before anything else reads it: too many header lines, or too many bytes of them, is a
provider-shaped 431 (`polar_max_headers`, `polar_max_header_kb`).

mitmproxy reads an HTTP/1 head of any size (h2 caps an HTTP/2 header list at 64 KiB), and its header mapping is
slow per name (each `headers[name]` scans every line: `headers.items()` is quadratic). 100k small headers held a
gateway at 100% CPU for minutes, deaf to SIGTERM. The check here reads the raw lines once; everything after it
sees a bounded head. No mitmproxy import: the addon passes the lines (`headers.fields`).
"""

from __future__ import annotations

from collections.abc import Iterable

from polar_mitm.codecs import DEFAULT_CODEC, Codec, by_path, provider_for
from polar_mitm.codecs.base import GatewayError, HttpAnswer
from polar_mitm.gateway import identity as ident
from polar_mitm.gateway.live import Responder

LINE_OVERHEAD = 4  # ": " and CRLF: a line's size on the wire beyond its name and value


def head_excess(fields: Iterable[tuple[bytes, bytes]], *, max_count: int, max_bytes: int) -> str | None:
    """What is too large about these header lines (name, value), or None; stops at the first line past a limit."""
    count = size = 0
    for name, value in fields:
        count += 1
        size += len(name) + len(value) + LINE_OVERHEAD
        if count > max_count:
            return f"more than {max_count} header lines (polar_max_headers)"
        if size > max_bytes:
            return f"headers larger than {max_bytes >> 10} KiB in all (polar_max_header_kb)"
    return None


def refusal(host: str, path: str, names: Iterable[str], excess: str, *, reverse: bool) -> HttpAnswer:
    """The 431 for a request whose head is too large, in the shape of the provider it is for (by its path, host
    or header names, as the gateway tells any request's provider); OpenAI's when nothing tells."""
    path = ident.strip_path_prefix(path.split("?", 1)[0])[0]
    lower_names = {name.lower(): "" for name in names}
    codec: Codec = by_path(path) or provider_for(host, lower_names, path, reverse=reverse) or DEFAULT_CODEC
    return codec.encode_error(GatewayError("headers_too_large", f"polar-mitm: the request has {excess}"))


class FixedAnswer:
    """An answer decided at the headers, sent from behind the loopback hop while mitmproxy drops the body as it
    arrives (an answer set in `requestheaders` would make mitmproxy buffer the whole body first)."""

    def __init__(self, answer: HttpAnswer) -> None:
        self.answer = answer
        self.row = None  # nothing recorded

    def stop(self, reason: str) -> None:
        return None

    async def run(self, out: Responder) -> None:
        body = self.answer.body
        try:
            await out.begin(
                self.answer.status,
                self.answer.content_type,
                {**(self.answer.headers or {}), "content-length": str(len(body))},
            )
            await out.send(body)
            await out.end()
        except (ConnectionError, OSError, RuntimeError):
            pass  # the client is gone
