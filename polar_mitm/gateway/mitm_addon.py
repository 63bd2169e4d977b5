"""The mitmproxy addon: options, hooks, and the hand-off to `Gateway` (the only module that imports mitmproxy).

Works in regular mode (harness sets HTTPS_PROXY and trusts mitmproxy's CA) and reverse mode (harness base URL
points here). Options are declared in `load` and set with `--set name=value`.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Optional

from mitmproxy import ctx, http
from mitmproxy.proxy.mode_specs import ReverseMode

from polar_mitm.gateway import identity as ident
from polar_mitm.gateway.engine_client import EngineClient
from polar_mitm.gateway.journal import RecordWriter
from polar_mitm.gateway.service import Gateway, GatewayConfig, GatewayRequest
from polar_mitm.records import last_seq_by_session

log = logging.getLogger("polar_mitm.addon")


def optional_float(value: str | None, name: str) -> float | None:
    if value in (None, ""):
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{name} must be a number, got {value!r}") from exc


class PolarGateway:
    """Answers model calls from the engine, records them under `polar_out`, handles the rest per passthrough."""

    def __init__(self) -> None:
        self.gateway: Gateway | None = None
        self.writer: RecordWriter | None = None
        self.engine: EngineClient | None = None
        self._proxy_users: dict[str, str] = {}

    def load(self, loader) -> None:
        loader.add_option("polar_backend", str, "http://127.0.0.1:30000",
                          "Engine base URL (SGLang or `polar-mitm serve`).")
        loader.add_option("polar_out", str, "flows", "Directory (created if missing) for the Parquet records.")
        loader.add_option("polar_passthrough", str, "block",
                          "Non-model traffic: `block` (answer locally with a clear 404) or `upstream` (forward).",
                          choices=["block", "upstream"])
        loader.add_option("polar_temperature", Optional[str], None,  # noqa: UP045 (mitmproxy typespec)
                          "Force this sampling temperature on every call (RL wants the trainer's temperature).")
        loader.add_option("polar_top_p", Optional[str], None,  # noqa: UP045
                          "Force this top_p on every call.")
        loader.add_option("polar_max_tokens", int, 0, "Cap each call's max tokens (0 = no cap).")
        loader.add_option("polar_engine_timeout", int, 600, "Seconds to wait for the engine per call.")
        loader.add_option("polar_rotate_mb", int, 64, "Compact the journal into a Parquet shard at this size.")
        loader.add_option("polar_rotate_seconds", int, 300, "… or at this age.")
        loader.add_option("polar_fsync", bool, True,
                          "fsync each record before answering (off: a crash may lose the last ~1 s of records).")
        loader.add_option("polar_models", str, "", "Extra model ids (comma-separated) for model listings.")

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        if self.writer is None or {"polar_out", "polar_rotate_mb", "polar_rotate_seconds", "polar_fsync"} & updated:
            if self.writer is not None:
                self.writer.close()
            out = Path(opts.polar_out)
            self.writer = RecordWriter(out, rotate_bytes=opts.polar_rotate_mb << 20,
                                       rotate_seconds=opts.polar_rotate_seconds, fsync=opts.polar_fsync)
            self.writer.start()
            # An unreadable shard is moved aside with its reason; it must never keep the gateway from serving.
            last_seq = last_seq_by_session(out, on_unreadable=self.writer.quarantine_shard)
        else:
            last_seq = None
        if self.engine is None or {"polar_backend", "polar_engine_timeout"} & updated:
            self.engine = EngineClient(opts.polar_backend, timeout=opts.polar_engine_timeout)
        config = GatewayConfig(
            passthrough=opts.polar_passthrough,
            temperature=optional_float(opts.polar_temperature, "polar_temperature"),
            top_p=optional_float(opts.polar_top_p, "polar_top_p"),
            max_tokens=opts.polar_max_tokens or None,
            extra_models=[m.strip() for m in opts.polar_models.split(",") if m.strip()],
        )
        previous = self.gateway
        self.gateway = Gateway(config, self.engine, self.writer)
        if previous is not None and last_seq is None:
            self.gateway._seq = previous._seq  # keep numbering across option changes
        elif last_seq:
            self.gateway.seed_sequences(last_seq)

    def running(self) -> None:
        # Never dial the real provider when a tunnel opens: model calls are answered here.
        if ctx.options.polar_passthrough == "block" and ctx.options.connection_strategy != "lazy":
            ctx.options.update(connection_strategy="lazy")

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Regular mode: remember the proxy user (our session carrier) of this client connection."""
        user = self._user_of(flow)
        if user:
            self._proxy_users[flow.client_conn.id] = user
        flow.request.headers.pop("Proxy-Authorization", None)

    def client_disconnected(self, client) -> None:
        self._proxy_users.pop(client.id, None)

    def _user_of(self, flow: http.HTTPFlow) -> str | None:
        auth = flow.metadata.get("proxyauth")  # set when mitmproxy's own proxyauth option is on
        if auth:
            return ident.split_task(auth[0])[1] and auth[0]
        return ident.proxy_user(flow.request.headers.get("Proxy-Authorization"))

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or self.gateway is None:
            return
        user = self._user_of(flow) or self._proxy_users.get(flow.client_conn.id)
        headers = {k.lower(): v for k, v in flow.request.headers.items()}
        req = GatewayRequest(
            method=flow.request.method,
            host=flow.request.pretty_host,
            path=flow.request.path.split("?", 1)[0],
            query=dict(flow.request.query.items()),
            headers=headers,
            body=flow.request.raw_content or b"",
            mode="reverse" if isinstance(flow.client_conn.proxy_mode, ReverseMode) else "regular",
            proxy_user=user,
            connection_id=flow.client_conn.id[:12],
        )
        try:
            answer = await self.gateway.handle(req)
        except Exception:  # the gateway must never take a flow down with it
            log.exception("polar gateway failed on %s %s", req.method, req.path)
            flow.response = http.Response.make(500, b'{"error": "polar-mitm internal error"}',
                                               {"content-type": "application/json"})
            return
        if answer is None:
            return  # passthrough upstream
        # Credentials never go further (not into `mitmdump -w` files, not into logs).
        for name in list(flow.request.headers.keys()):
            if name.lower() in ident.SECRET_HEADERS:
                del flow.request.headers[name]
        flow.request.headers.pop("Proxy-Authorization", None)
        if "key" in flow.request.query:
            del flow.request.query["key"]
        headers_out: dict[str, Any] = {"content-type": answer.content_type, **(answer.headers or {})}
        flow.response = http.Response.make(answer.status, answer.body, headers_out)
        if answer.meta:  # saved with `mitmdump -w`, so `polar-mitm import-flows` can rebuild the records
            flow.metadata.update(answer.meta)

    def done(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.engine is not None:
            try:
                loop = asyncio.get_running_loop()
                loop.create_task(self.engine.aclose())
            except RuntimeError:
                pass
