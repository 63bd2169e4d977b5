"""Header caps (issue 36 item 7): a request head with too many header lines or bytes gets the provider's 431 at
once, and the gateway stays responsive. Before, 100k small headers held the gateway at 100% CPU for minutes (its
header mapping looked every name up over every line) and 8k took 4 s.

A real gateway (`gateway_processes.start_gateway`) on the embedded engine; heads are written on a raw socket,
since an HTTP client takes as long to build 100k headers as the old gateway did to read them.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
from openai import OpenAI

from polar_mitm.gateway import processes as gateway_processes

CHAT = "/s/hdr/v1/chat/completions"
MESSAGES = "/s/hdr/v1/messages"
CHAT_BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()
MESSAGES_BODY = json.dumps(
    {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
).encode()


@pytest.fixture(scope="module")
def gateway(engine_url, tmp_path_factory) -> Iterator[gateway_processes.GatewayProcess]:
    root = tmp_path_factory.mktemp("header-limits")
    gw = gateway_processes.start_gateway(
        engine_url, root / "flows", confdir=root / "conf", log=root / "gateway.log"
    )
    yield gw
    gw.stop()


def send(
    gw: gateway_processes.GatewayProcess, path: str, body: bytes, extra: list[bytes], timeout: float = 60
) -> tuple[int, dict]:
    """POST `body` with the extra header lines over one raw HTTP/1.1 connection: (status, JSON answer)."""
    head = [
        f"POST {path} HTTP/1.1".encode(),
        f"host: 127.0.0.1:{gw.reverse_port}".encode(),
        b"content-type: application/json",
        b"anthropic-version: 2023-06-01",
        f"content-length: {len(body)}".encode(),
        b"connection: close",
        *extra,
    ]
    with socket.create_connection(("127.0.0.1", gw.reverse_port), timeout=timeout) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    _headers, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(payload or b"null")


def many(n: int) -> list[bytes]:
    return [f"x-h{i}: v".encode() for i in range(n)]


def chat_works(gw: gateway_processes.GatewayProcess) -> None:
    client = OpenAI(base_url=f"{gw.reverse_url}/s/after/v1", api_key="x", max_retries=0, timeout=60)
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message is not None


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(many(5000), id="5000-headers"),
        pytest.param([b"x-big: " + b"a" * (2 << 20)], id="2MB-header"),
    ],
)
def test_a_head_over_the_caps_gets_the_providers_431_quickly(gateway, extra):
    started = time.monotonic()
    status, answer = send(gateway, CHAT, CHAT_BODY, extra)
    assert status == 431, answer
    assert answer["error"]["code"] == "request_header_fields_too_large", answer  # OpenAI's shape
    status, answer = send(gateway, MESSAGES, MESSAGES_BODY, extra)
    assert status == 431, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "request_too_large", answer  # Anthropic's
    assert time.monotonic() - started < 30
    chat_works(gateway)


def test_100k_headers_are_answered_and_the_gateway_serves_on(gateway):
    started = time.monotonic()
    status, _ = send(gateway, CHAT, CHAT_BODY, many(100_000))
    assert status == 431
    assert time.monotonic() - started < 30
    chat_works(gateway)


def test_a_request_with_200_headers_is_served(gateway):
    status, answer = send(gateway, CHAT, CHAT_BODY, many(200))
    assert status == 200, answer
    assert answer["choices"][0]["message"] is not None
