"""Request bodies as the harness meant them: `Content-Encoding` decoded, never past a size limit.

SDKs and harnesses may compress large prompts. mitmproxy can decode them too, but without a bound: a few KB of
gzip can expand to gigabytes, so every decoder here stops at `limit` bytes of output.
"""

from __future__ import annotations

import zlib

import brotli
import zstandard

from polar_mitm.codecs.base import GatewayError

CHUNK = 1 << 16  # output read per step from a bounded reader (zstd)
# Input fed per step to brotli, whose decoder has no output bound: small, so one step cannot expand to much.
BROTLI_STEP = 1 << 10


def too_large(limit: int) -> GatewayError:
    return GatewayError(
        "too_large",
        f"the request body is larger than this gateway's limit of {limit >> 20} MiB (polar_max_body_mb)",
    )


def decode_content(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decoded per its Content-Encoding (codings listed in the order they were applied), ≤ `limit` bytes.

    Raises GatewayError: `invalid_request` for an unknown coding or corrupt data, `too_large` past the limit.
    """
    data = raw
    for coding in reversed([c.strip().lower() for c in encoding.split(",") if c.strip()]):
        try:
            data = _decode_one(data, coding, limit)
        except (zlib.error, zstandard.ZstdError, brotli.error) as exc:
            raise GatewayError(
                "invalid_request", f"the request body is not valid {coding} data: {exc}"
            ) from exc
        if len(data) > limit:
            raise too_large(limit)
    return data


def _decode_one(data: bytes, coding: str, limit: int) -> bytes:
    if coding == "identity":
        return data
    if coding in ("gzip", "x-gzip"):
        return _zlib(data, zlib.MAX_WBITS | 16, limit)
    if coding == "deflate":  # RFC 9110 says zlib-wrapped; some clients send raw deflate
        try:
            return _zlib(data, zlib.MAX_WBITS, limit)
        except zlib.error:
            return _zlib(data, -zlib.MAX_WBITS, limit)
    if coding == "zstd":
        return _zstd(data, limit)
    if coding == "br":
        return _brotli(data, limit)
    raise GatewayError(
        "invalid_request", f"unsupported Content-Encoding {coding!r} (use gzip, deflate, br or zstd)"
    )


def _zlib(data: bytes, wbits: int, limit: int) -> bytes:
    """zlib/deflate/gzip within `limit`; a gzip body may hold several members (RFC 1952), decoded one after the
    other as `gzip -d` does (`cat a.gz b.gz`, or a client that compresses per chunk)."""
    out = bytearray()
    rest = data
    while True:
        decoder = zlib.decompressobj(wbits)
        out += decoder.decompress(rest, limit + 1 - len(out))
        if len(out) > limit or decoder.unconsumed_tail:
            raise too_large(limit)
        if not decoder.eof:
            raise zlib.error("truncated stream")
        rest = decoder.unused_data
        if not rest or wbits & 16 == 0:  # only gzip chains members; zlib/deflate end at their stream's end
            return bytes(out)


def _zstd(data: bytes, limit: int) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
    out = bytearray()
    while chunk := reader.read(CHUNK):
        out += chunk
        if len(out) > limit:
            raise too_large(limit)
    return bytes(out)


def _brotli(data: bytes, limit: int) -> bytes:
    decoder = brotli.Decompressor()
    out = bytearray()
    for start in range(0, len(data), BROTLI_STEP):
        out += decoder.process(data[start : start + BROTLI_STEP])
        if len(out) > limit:
            raise too_large(limit)
    if not decoder.is_finished():
        raise brotli.error("truncated stream")
    return bytes(out)
