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
from polar_mitm.gateway.engine_info import record_engine
from polar_mitm.gateway.exposure import exposure_warning
from polar_mitm.gateway.live import LiveAnswer
from polar_mitm.gateway.live_server import PATH_PREFIX, LiveServer
from polar_mitm.gateway.prompts import PromptBuilder
from polar_mitm.gateway.service import Gateway, GatewayConfig, GatewayRequest
from polar_mitm.storage.journal import RecordWriter
from polar_mitm.storage.records import last_seq_by_session

log = logging.getLogger("polar_mitm.addon")

# Default completion budget per call (polar_max_tokens): long enough for any real agent turn (a large file written
# in one tool call), short enough that a degenerate sample cannot hold the engine for its whole context.
DEFAULT_MAX_TOKENS = 8192


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
        self.prompts: PromptBuilder | None = None
        self._proxy_users: dict[str, str] = {}
        self._disconnects: dict[str, asyncio.Event] = {}  # client connection id → set when it closes
        self.live = LiveServer()  # sends live-streamed answers, which mitmproxy streams on (live_server.py)
        self._live_flows: dict[str, tuple[str, dict[str, Any], LiveAnswer]] = {}  # flow id → (token, request, answer)
        self._engine_task: asyncio.Task | None = None  # writes <polar_out>/_engine.json once the engine answers

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
        loader.add_option("polar_max_tokens", int, DEFAULT_MAX_TOKENS,
                          "Cap each call's completion tokens, whatever the harness asks (0 = no cap). Bounds a "
                          "degenerate RL sample; harnesses that send no max_tokens (Codex) get this budget.")
        loader.add_option("polar_engine_timeout", int, 600, "Seconds to wait for the engine per call.")
        loader.add_option("polar_rotate_mb", int, 64, "Compact the journal into a Parquet shard at this size.")
        loader.add_option("polar_rotate_seconds", int, 300, "… or at this age.")
        loader.add_option("polar_fsync", bool, True,
                          "fsync each record before answering (off: a crash may lose the last ~1 s of records).")
        loader.add_option("polar_models", str, "", "Extra model ids (comma-separated) for model listings.")
        loader.add_option("polar_max_body_mb", int, 64,
                          "Largest request body in MiB, compressed or decoded; larger ones get a provider-shaped 413.")
        loader.add_option("polar_prompt_mode", str, "tokens",
                          "`tokens`: send the engine the session's exact token stream + the new tail (every sampled "
                          "token trained in the context it was sampled in); `messages`: the engine renders the "
                          "harness's messages.", choices=["tokens", "messages"])
        loader.add_option("polar_tokenizer", str, "",
                          "Engine tokenizer for tokens mode (a local path; empty: the engine's /model_info path).")
        loader.add_option("polar_stream", str, "live",
                          "Streamed calls: `live` (the engine streams; the harness gets events as tokens are sampled) "
                          "or `replay` (answer whole from the engine, then replay it as SSE; for engines that cannot "
                          "stream ids).", choices=["live", "replay"])
        loader.add_option("polar_keepalive_seconds", str, "10",  # a str: `--set` cannot parse float options
                          "Live streams: send the provider's keep-alive (Anthropic ping, SSE comment) after this "
                          "many seconds of silence, so harness idle timeouts do not fire (0 = never).")

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
            max_body_bytes=opts.polar_max_body_mb << 20,
            stream=opts.polar_stream,
            keepalive_seconds=optional_float(opts.polar_keepalive_seconds, "polar_keepalive_seconds") or 0.0,
        )
        previous = self.gateway
        if self.prompts is None or {"polar_prompt_mode", "polar_tokenizer", "polar_backend"} & updated:
            self.prompts = PromptBuilder(opts.polar_prompt_mode, tokenizer=opts.polar_tokenizer,
                                         model_info=self.engine.model_info)
        self.gateway = Gateway(config, self.engine, self.writer, self.prompts)
        if previous is not None and last_seq is None:
            self.gateway._seq = previous._seq  # keep numbering across option changes
        elif last_seq:
            self.gateway.seed_sequences(last_seq)

    def running(self) -> None:
        # Never dial the real provider when a tunnel opens: model calls are answered here.
        if ctx.options.polar_passthrough == "block" and ctx.options.connection_strategy != "lazy":
            ctx.options.update(connection_strategy="lazy")
        warning = exposure_warning(ctx.options.mode, ctx.options.listen_host, ctx.options.proxyauth,
                                   ctx.options.listen_port)
        if warning:
            log.warning(warning)
        # Describe the engine next to the records (what merge needs), and load tokens mode's renderer now rather
        # than on the first call. A strong reference: the event loop keeps only weak ones to its tasks.
        if self.engine is not None and self.prompts is not None:
            self._engine_task = asyncio.get_running_loop().create_task(record_engine(
                Path(ctx.options.polar_out), ctx.options.polar_backend, self.engine.model_info, self.prompts.warm))

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Regular mode: remember the proxy user (our session carrier) of this client connection."""
        user = self._user_of(flow)
        if user:
            self._proxy_users[flow.client_conn.id] = user
        flow.request.headers.pop("Proxy-Authorization", None)

    def client_disconnected(self, client) -> None:
        """Forget the connection; cancel its model calls still waiting for the engine (they are recorded `abort`)."""
        self._proxy_users.pop(client.id, None)
        event = self._disconnects.pop(client.id, None)
        if event is not None:
            event.set()

    def _disconnect_event(self, client) -> asyncio.Event:
        """The event `client_disconnected` sets for this client connection."""
        event = self._disconnects.get(client.id)
        if event is None:
            event = self._disconnects[client.id] = asyncio.Event()
            if client.timestamp_end is not None:  # already gone before its request reached us
                event.set()
        return event

    def _user_of(self, flow: http.HTTPFlow) -> str | None:
        auth = flow.metadata.get("proxyauth")  # set when mitmproxy's own proxyauth option is on
        if auth:
            return auth[0] or None
        return ident.proxy_user(flow.request.headers.get("Proxy-Authorization"))

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or self.gateway is None:
            return
        req = self._gateway_request(flow)
        # Credentials never go further (not into `mitmdump -w` files, not into logs): removed before any handling,
        # so no failure can leave them in the flow. Only a flow that may be forwarded keeps them until it is not.
        if not (req.mode == "regular" and self.gateway.config.passthrough == "upstream"):
            ident.scrub_credentials(flow.request.headers, flow.request.query)
        answer = await self.gateway.handle(req)  # never raises: failures come back provider-shaped
        if answer is None:
            return  # passthrough upstream: the real provider needs the credentials
        ident.scrub_credentials(flow.request.headers, flow.request.query)
        if isinstance(answer, LiveAnswer):
            await self._go_live(flow, answer)
            return
        headers_out: dict[str, Any] = {"content-type": answer.content_type, **(answer.headers or {})}
        flow.response = http.Response.make(answer.status, answer.body, headers_out)
        if answer.meta:  # saved with `mitmdump -w`, so `polar-mitm import-flows` can rebuild the records
            flow.metadata.update(answer.meta)

    async def _go_live(self, flow: http.HTTPFlow, answer: LiveAnswer) -> None:
        """Send the flow to the live server, which writes the answer as it is generated (see live_server.py)."""
        await self.live.start()
        token = self.live.register(answer)
        req = flow.request
        self._live_flows[flow.id] = (token, {"scheme": req.scheme, "host": req.host, "port": req.port,
                                             "path": req.path, "headers": req.headers.copy(),
                                             "raw_content": req.raw_content}, answer)
        req.scheme, req.host, req.port = "http", "127.0.0.1", self.live.port
        req.path = PATH_PREFIX + token
        # The answer is already planned: no need to copy the prompt over loopback.
        for name in ("content-encoding", "transfer-encoding"):
            req.headers.pop(name, None)
        req.headers["content-length"] = "0"
        req.raw_content = b""

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """A live answer's body is streamed to the harness chunk by chunk, as the live server writes it."""
        if flow.id in self._live_flows:
            flow.response.stream = True

    def response(self, flow: http.HTTPFlow) -> None:
        live = self._live_flows.pop(flow.id, None)
        if live is not None:
            _token, original, answer = live
            self._restore(flow, original)
            if answer.row is not None:  # saved with `mitmdump -w`, as for answers sent whole
                flow.metadata["polar_record"] = answer.row

    def error(self, flow: http.HTTPFlow) -> None:
        """A live flow that failed before its answer was fetched still gets its call run (and recorded)."""
        live = self._live_flows.pop(flow.id, None)
        if live is not None:
            token, original, _answer = live
            self.live.abandon(token)
            self._restore(flow, original)

    @staticmethod
    def _restore(flow: http.HTTPFlow, original: dict[str, Any]) -> None:
        """The request as the harness sent it (for `mitmdump -w` files and logs)."""
        req = flow.request
        req.scheme, req.host, req.port, req.path = (original["scheme"], original["host"], original["port"],
                                                    original["path"])
        req.headers = original["headers"]
        req.raw_content = original["raw_content"]

    def _gateway_request(self, flow: http.HTTPFlow) -> GatewayRequest:
        """The flow as the gateway sees it: credentials still in (identity reads `polar-…` keys), text made UTF-8.

        Header and path bytes that are not UTF-8 reach us as lone surrogates, which no JSON encoder or Parquet
        column accepts: they become U+FFFD here, once.
        """
        safe = ident.safe_text
        user = self._user_of(flow) or self._proxy_users.get(flow.client_conn.id)
        return GatewayRequest(
            method=safe(flow.request.method),
            host=safe(flow.request.pretty_host),
            path=safe(flow.request.path.split("?", 1)[0]),
            query={safe(k): safe(v) for k, v in flow.request.query.items()},
            headers={safe(k).lower(): safe(v) for k, v in flow.request.headers.items()},
            body=flow.request.raw_content or b"",
            content_encoding=safe(flow.request.headers.get("content-encoding", "")),
            mode="reverse" if isinstance(flow.client_conn.proxy_mode, ReverseMode) else "regular",
            proxy_user=safe(user) if user else None,
            connection_id=flow.client_conn.id[:12],
            disconnected=self._disconnect_event(flow.client_conn),
        )

    def done(self) -> None:
        if self._engine_task is not None:
            self._engine_task.cancel()
        if self.writer is not None:
            self.writer.close()
        if self.engine is not None:
            try:
                loop = asyncio.get_running_loop()
                loop.create_task(self.engine.aclose())
                loop.create_task(self.live.close())
            except RuntimeError:
                pass
