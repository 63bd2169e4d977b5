"""The mitmproxy addon: options, hooks, and the hand-off to `Gateway` (the only module that imports mitmproxy).

Works in regular mode (harness sets HTTPS_PROXY and trusts mitmproxy's CA) and reverse mode (harness base URL
points here). Options are declared once, in `GatewayOptions` (gateway/options.py): `load` adds them, `configure`
parses them all into one before applying any, and they are set with `--set name=value`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import orjson
from mitmproxy import ctx, http
from mitmproxy.exceptions import OptionsError
from mitmproxy.proxy.mode_specs import ReverseMode

from polar_mitm.codecs import DEFAULT_CODEC, by_path
from polar_mitm.codecs.base import GatewayError, HttpAnswer
from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines.client import EngineClient
from polar_mitm.engines.description import record_engine
from polar_mitm.gateway import control, log_redaction, request_head
from polar_mitm.gateway import identity as ident
from polar_mitm.gateway.cancel import SHUTDOWN, CallCancel
from polar_mitm.gateway.exposure import exposure_warning
from polar_mitm.gateway.live import ABORT_DRAIN_SECONDS, LiveAnswer, Responder
from polar_mitm.gateway.live_server import PATH_PREFIX, LiveServer
from polar_mitm.gateway.options import (
    PREFIX,
    STARTUP_ONLY,
    GatewayOptions,
    OptionError,
    mitmproxy_options,
    parse_options,
)
from polar_mitm.gateway.prompts import PromptBuilder
from polar_mitm.gateway.service import Gateway, GatewayRequest
from polar_mitm.processes import secret_handover
from polar_mitm.storage.journal import RecordWriter
from polar_mitm.storage.records import last_seq_by_session

log = logging.getLogger(__name__)

STARTED = time.monotonic()  # the addon's import: the gateway process has just started

WRITER_OPTIONS = (
    "out",
    "rotate_mb",
    "rotate_seconds",
    "fsync",
)  # GatewayOptions fields the writer is made from
ENGINE_OPTIONS = ("backend", "engine", "engine_timeout")
PROMPT_OPTIONS = ("prompt_mode", "tokenizer", "backend", "engine")


def stop_process(message: str) -> NoReturn:
    """The addon cannot run as configured: one line on stderr, and the proxy stops before it serves anything.

    A SystemExit, not an exception mitmproxy would log and carry on past: a proxy whose addon is not in charge
    forwards every request to the real provider (fail open).
    """
    print(f"polar-mitm: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_deferred_options(options: Any) -> None:
    """Apply the `--set polar_…` values mitmproxy deferred until our options exist, or stop the process.

    mitmproxy applies them right after `load`, in the script loader's task, where an error (an option given
    twice, a value that is not an int) is lost: the addon is then registered but never called, and the proxy
    forwards everything upstream. Applying them here, with mitmproxy's own parser, turns that into a stop.
    """
    ours = {name: value for name, value in options.deferred.items() if name.startswith(PREFIX)}
    for name in ours:
        del options.deferred[name]
    for name, value in ours.items():
        if name not in options:
            stop_process(f"unknown option {name} (see README's gateway options)")
        texts = deferred_texts(value)
        try:
            if texts is None:  # deferred as a value (an options file, Python), not as `--set` text
                options.update(**{name: value})
            else:  # `options.set` is what `--set` and the `set` command use: mitmproxy's parser, then update
                options.set(*([f"{name}={text}" for text in texts] or [name]))
        except OptionsError as exc:
            if texts is not None and len(texts) > 1:
                stop_process(f"{name} is set {len(texts)} times ({', '.join(map(repr, texts))}); set it once")
            shown = value if texts is None else (texts[0] if texts else "")
            stop_process(f"cannot apply --set {name}={shown}: {exc}")


def deferred_texts(value: Any) -> list[str] | None:
    """The `--set` texts of a deferred option; None when it was deferred as a value.

    The one place that knows how mitmproxy keeps deferred `--set` texts: an object with the texts as `val`
    (optmanager's `_UnconvertedStrings`), which mitmproxy exposes no public name for.
    """
    texts = getattr(value, "val", None)
    return list(texts) if isinstance(texts, list) else None


def control_refused() -> HttpAnswer:
    """A control call without the token: the same answer whatever is wrong (nothing for a guesser to learn)."""
    answer = DEFAULT_CODEC.encode_error(GatewayError("internal", "polar-mitm: control call refused"))
    answer.status = 403
    return answer


def error_answer(status: int, message: str) -> http.Response:
    """A provider-neutral (OpenAI-shaped) error for a request the gateway cannot hand to its codecs."""
    answer = DEFAULT_CODEC.encode_error(GatewayError("internal", message))
    return http.Response.make(status, answer.body, {"content-type": answer.content_type})


class PolarGateway:
    """Answers model calls from the engine, records them under `polar_out`, handles the rest per passthrough.

    Fails closed: a request is forwarded upstream only when the gateway decided so (`polar_passthrough=upstream`,
    regular mode, not a model call); any other state — not configured, shutting down, a bug — answers an error.
    """

    def __init__(self) -> None:
        self.options: GatewayOptions | None = None  # the options applied (parsed and checked)
        self.gateway: Gateway | None = None
        self.writer: RecordWriter | None = None
        self.engine: EngineClient | None = None
        self.prompts: PromptBuilder | None = None
        self.is_running = False  # past startup: a bad option is refused (rolled back) rather than fatal
        self.closing = False
        self._proxy_users: dict[str, str] = {}
        self._connections: dict[str, set[str]] = {}  # client connection id → ids of its flows in a model call
        self._calls: dict[str, CallCancel] = {}  # flow id → the cancel of its call (while the call runs)
        self._credentials: dict[str, ident.Credentials] = {}  # flow id → what requestheaders took off it
        self._handling: set[asyncio.Task] = set()  # calls answered inline (not via the live server)
        self.live = LiveServer()  # sends live-streamed answers, which mitmproxy streams on (live_server.py)
        self._live_flows: dict[
            str, tuple[str, dict[str, Any], Any]
        ] = {}  # flow id → (token, request, answer)
        self._engine_task: asyncio.Task | None = (
            None  # writes <polar_out>/_engine.json once the engine answers
        )
        self._warm_task: asyncio.Task | None = None  # loads the renderer while the gateway starts
        self._control_token = control.take_token()  # None: no control call (gateway/control.py)
        # Set by a rollout that starts us: only calls with a valid session credential (session_ids.py).
        self._session_key = secret_handover.take("session_key")

    def load(self, loader) -> None:
        for option in mitmproxy_options():
            loader.add_option(
                option.name,
                option.typespec,
                option.default,
                option.help,
                choices=list(option.choices) if option.choices else None,
            )
        check_deferred_options(loader.master.options)
        log_redaction.install()

    # -- configuration: parse and check everything first, then apply (mitmproxy's option contract) -------------

    def configure(self, updated: set[str]) -> None:
        """Parse every option into `GatewayOptions` and build what changed, raising OptionsError before anything
        is replaced (mitmproxy then rolls the change back, and calls this again with the old values, which changes
        nothing); at startup, when there is nothing to roll back to, a bad option stops the process instead."""
        try:
            options = parse_options(ctx.options)
        except OptionError as exc:
            self._refuse(str(exc))
        previous = self.options
        if options == previous:
            return
        if self.is_running and previous is not None:
            for name in STARTUP_ONLY:
                if getattr(options, name) != getattr(previous, name):
                    self._refuse(f"{PREFIX}{name} is set when the gateway starts, never while it runs")
        changed = {
            f
            for f in GatewayOptions.__dataclass_fields__
            if previous is None or getattr(options, f) != getattr(previous, f)
        }
        writer, last_seq = self.writer, None
        if writer is None or changed & set(WRITER_OPTIONS):
            writer, last_seq = self._new_writer(options)
        engine = self.engine
        if engine is None or changed & set(ENGINE_OPTIONS):
            try:
                engine = EngineClient(options.backend, timeout=options.engine_timeout, kind=options.engine)
            except (
                engine_keys.KeyFileError
            ) as exc:  # $POLAR_ENGINE_KEY_FILE unusable: one line, not a traceback
                self._refuse(str(exc))
        prompts = previous_prompts = self.prompts
        if prompts is None or changed & set(PROMPT_OPTIONS):
            prompts = PromptBuilder(
                options.prompt_mode, tokenizer=options.tokenizer, model_info=engine.model_info
            )
        gateway = Gateway(options, engine, writer, prompts, session_key=self._session_key)
        if last_seq is None and self.gateway is not None:
            gateway.continue_numbering(self.gateway)  # the same records folder: its numbering goes on
        elif last_seq:
            gateway.seed_sequences(last_seq)
        self.options, self.writer, self.engine, self.prompts, self.gateway = (
            options,
            writer,
            engine,
            prompts,
            gateway,
        )
        if prompts is not previous_prompts:  # a new prompt builder: load its renderer now, not on a call
            self._start_background()
        elif (
            previous is not None and "out" in changed
        ):  # a new records folder: the engine described in it too
            self._start_engine_record()

    def _refuse(self, message: str) -> NoReturn:
        if not self.is_running:
            stop_process(message)
        raise OptionsError(message)

    def _new_writer(self, options: GatewayOptions) -> tuple[RecordWriter, dict[str, int]]:
        """The journal writer for `options`, started, and the last seq of each session already in its folder."""
        out = Path(options.out)
        previous = self.writer
        if previous is not None and previous.out_dir.resolve() == out.resolve():
            previous.close()  # one writer per journal folder
            previous = None
        writer = RecordWriter(
            out,
            rotate_bytes=options.rotate_mb << 20,
            rotate_seconds=options.rotate_seconds,
            fsync=options.fsync,
        )
        try:
            writer.start()
        except OSError as exc:
            self._refuse(f"{PREFIX}out={options.out!r} cannot hold records: {exc}")
        if previous is not None:
            previous.close()
        # An unreadable shard is moved aside with its reason; it must never keep the gateway from serving.
        return writer, last_seq_by_session(out, on_unreadable=writer.quarantine_shard)

    def running(self) -> None:
        self.is_running = True
        # Never dial the real provider when a tunnel opens: model calls are answered here.
        if ctx.options.polar_passthrough == "block" and ctx.options.connection_strategy != "lazy":
            ctx.options.update(connection_strategy="lazy")
        warning = exposure_warning(
            ctx.options.mode, ctx.options.listen_host, ctx.options.proxyauth, ctx.options.listen_port
        )
        if warning:
            log.warning(warning)
        if self._warm_task is None:  # configure had no event loop to start it on
            self._start_background()

    def _start_background(self) -> None:
        """Load what the hot path needs (tokens mode's renderer) now, in a worker thread, and say when it is
        ready; describe the engine next to the records (what merge needs). Strong references: the event loop
        keeps only weak ones to its tasks."""
        if self.engine is None or self.prompts is None or self.options is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # configured outside mitmproxy's loop (tests): the first call loads it
            return
        if self._warm_task is not None:
            self._warm_task.cancel()
        self._warm_task = loop.create_task(self._warm_up(self.prompts))
        self._start_engine_record()

    def _start_engine_record(self) -> None:
        """Write `<polar_out>/_engine.json` once the engine answers (engine_info.py)."""
        if self.engine is None or self.prompts is None or self.options is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._engine_task is not None:
            self._engine_task.cancel()
        self._engine_task = loop.create_task(
            record_engine(
                Path(self.options.out),
                self.options.backend,
                self.engine.model_info,
                self.prompts.warm,
            )
        )

    async def _warm_up(self, prompts: PromptBuilder) -> None:
        await prompts.warm()
        ready, detail = prompts.readiness()
        if ready:  # the line runners and people wait for (also answered at GET /_polar/ready)
            log.info("polar-mitm gateway ready, %.1f s after start: %s", time.monotonic() - STARTED, detail)

    # -- a flow's life -------------------------------------------------------------------------------------------

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Regular mode: remember the proxy user (our session carrier) of this client connection."""
        user = self._user_of(flow)
        if user:
            self._proxy_users[flow.client_conn.id] = user
        flow.request.headers.pop("Proxy-Authorization", None)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Credentials leave the flow as soon as its headers are here: a request that never completes (a short
        or malformed body) reaches `error` and `mitmdump -w` files without `request` ever running.

        First of all, a head over the header limits is refused with the provider's 431 (request_head.py).
        A control call with the token is then left whole to `request`, whatever the body limit; without it, it
        is refused now. A body the gateway would buffer past its limit is not buffered: a `Content-Length` over
        the limit is refused now (the body is read and dropped as it comes), and a chunked body is read by the
        loopback hop, which stops at the limit. Both answer the provider's 413 and are recorded.
        """
        if self.options is not None and flow.response is None:
            excess = request_head.head_excess(
                flow.request.headers.fields,
                max_count=self.options.max_headers,
                max_bytes=self.options.max_header_bytes,
            )
            if excess is not None:
                await self._refuse_at_headers(flow, self._head_refusal(flow, excess))
                return
        credentials = self._credentials[flow.id] = ident.take_credentials(
            flow.request.headers, flow.request.query
        )
        if self._is_control(flow):
            given = flow.request.headers.pop(control.TOKEN_HEADER, "")
            if flow.request.method == "POST" and control.authorized(self._control_token, given):
                flow.metadata["polar_control"] = True  # `request` answers it, with its whole body
                return
            del self._credentials[flow.id]
            await self._refuse_at_headers(flow, control_refused())
            return
        if self.gateway is None or self.closing or flow.response is not None:
            return  # `request` answers it
        length, chunked = body_framing(flow.request.headers)
        too_large = length is not None and length > self.gateway.config.max_body_bytes
        if not (too_large or chunked):
            return
        req = self._gateway_request(flow, credentials)
        if not self._answered_here(req):
            return  # may be forwarded: mitmproxy reads it whole, `request` decides
        del self._credentials[flow.id]
        req.body_too_large = too_large
        await self._go_live(flow, DeferredCall(self, req, read_body=not too_large), keep_body=not too_large)
        if too_large:
            flow.request.stream = drop_body
        else:
            flow.request.stream = True

    async def request(self, flow: http.HTTPFlow) -> None:
        """Fail closed: whatever goes wrong here, the flow gets an answer and never goes upstream unasked."""
        if flow.response is not None:
            return
        try:
            await self._request(flow)
        except Exception as exc:  # a gateway bug must not let the request through to the real provider
            log.exception("unexpected error on %s %s", flow.request.method, flow.request.path)
            flow.response = error_answer(500, f"polar-mitm internal error: {exc!r}")
        finally:
            if flow.response is None and flow.id not in self._live_flows and not self._forwarding(flow):
                flow.response = error_answer(502, "polar-mitm: this request has no answer (refused)")

    async def _request(self, flow: http.HTTPFlow) -> None:
        if flow.id in self._live_flows:  # sent to the loopback hop at its headers (requestheaders)
            return
        if self._is_control(flow):
            flow.response = await self._control(flow)
            return
        credentials = self._credentials.pop(flow.id, None) or ident.take_credentials(
            flow.request.headers, flow.request.query
        )
        if self.gateway is None:
            flow.response = error_answer(
                503, "polar-mitm: the gateway is not configured; nothing is forwarded"
            )
            return
        if self.closing:
            flow.response = error_answer(503, "polar-mitm: the gateway is shutting down")
            return
        req = self._gateway_request(flow, credentials)
        if flow.request.is_http2 and self._is_model_call(req):
            # HTTP/2: a stream reset is invisible to this hook while it runs; behind the loopback hop it
            # closes the hop, which cancels the call (live_server.py).
            await self._go_live(flow, DeferredCall(self, req))
            return
        answer = await self._handle(flow, req)
        if answer is None:  # passthrough upstream: the real provider needs the credentials
            ident.restore_credentials(flow.request.headers, flow.request.query, credentials)
            flow.metadata["polar_forward"] = True
            return
        if isinstance(answer, LiveAnswer):
            await self._go_live(flow, answer)
            return
        flow.response = make_response(answer)
        if answer.meta:  # saved with `mitmdump -w`, so `polar-mitm import-flows` can rebuild the records
            flow.metadata.update(answer.meta)

    def _is_control(self, flow: http.HTTPFlow) -> bool:
        return self._control_token is not None and flow.request.path.split("?", 1)[0] == control.CONTROL_PATH

    def _head_refusal(self, flow: http.HTTPFlow, excess: str) -> HttpAnswer:
        req = flow.request
        return request_head.refusal(
            req.pretty_host,
            req.path,
            (name for name, _ in req.headers.items(multi=True)),
            excess,
            reverse=isinstance(flow.client_conn.proxy_mode, ReverseMode),
        )

    async def _refuse_at_headers(self, flow: http.HTTPFlow, answer: HttpAnswer) -> None:
        """Answer `answer` now, dropping the body as it arrives (never buffered), the head kept out of the way.

        The request goes to the loopback hop with a bare head: its own may be what is refused (aiohttp, behind
        the hop, has limits of its own); the flow keeps its own head, without credentials, for `-w` files.
        """
        ident.take_credentials(flow.request.headers, flow.request.query)  # none of it is needed, none kept
        await self._go_live(flow, request_head.FixedAnswer(answer))
        flow.request.headers = http.Headers(host=f"127.0.0.1:{self.live.port}", content_length="0")
        flow.request.stream = drop_body

    async def _control(self, flow: http.HTTPFlow) -> http.Response:
        """`POST /_polar/control` (gateway/control.py): once the calls still running have ended, apply the options
        (a new records folder: the old journal is compacted into shards before this answers). The token was
        checked at the headers (`requestheaders`), before any body limit."""
        flow.request.headers.pop(control.TOKEN_HEADER, None)
        if not flow.metadata.get("polar_control"):
            return make_response(control_refused())
        try:
            texts = control.option_texts(flow.request.raw_content or b"")
        except ValueError as exc:
            return error_answer(400, f"polar-mitm: control call: {exc}")
        refusal = control.refusal(texts, self.options) if self.options is not None else None
        if refusal is not None:
            return error_answer(403, f"polar-mitm: control call refused: {refusal}")
        await self._wait_calls(control.DRAIN_SECONDS)
        if self._handling or self.live.busy:
            return error_answer(409, "polar-mitm: calls are still running; nothing changed")
        try:
            ctx.options.set(
                *texts
            )  # mitmproxy's parser, then configure (refused: rolled back, nothing changed)
        except OptionsError as exc:
            return error_answer(400, f"polar-mitm: control call: {exc}")
        if (
            self._engine_task is not None
        ):  # the new folder's _engine.json, before the caller sends calls there
            done, _ = await asyncio.wait(
                {asyncio.ensure_future(asyncio.shield(self._engine_task))}, timeout=30
            )
            if not done:
                log.warning("the engine description for %s is not written yet", self.options.out)
        body = {"out": self.options.out if self.options else None, "applied": texts}
        return http.Response.make(200, orjson.dumps(body), {"content-type": "application/json"})

    @staticmethod
    def _forwarding(flow: http.HTTPFlow) -> bool:
        return bool(flow.metadata.get("polar_forward"))

    @staticmethod
    def _is_model_call(req: GatewayRequest) -> bool:
        return req.method == "POST" and by_path(ident.strip_path_prefix(req.path)[0]) is not None

    def _answered_here(self, req: GatewayRequest) -> bool:
        """Whether the gateway answers `req` whatever its body (it is never forwarded upstream)."""
        forwarding = (
            req.mode == "regular"
            and self.gateway is not None
            and self.gateway.config.passthrough == "upstream"
        )
        return not forwarding or self._is_model_call(req)

    async def _handle(self, flow: http.HTTPFlow, req: GatewayRequest) -> HttpAnswer | LiveAnswer | None:
        """`gateway.handle` as a tracked task, so shutdown can wait for it and cancel it per call."""
        task = asyncio.ensure_future(self._handle_call(flow.id, flow.client_conn, req))
        self._handling.add(task)
        task.add_done_callback(self._handling.discard)
        return await asyncio.shield(task)

    async def _handle_call(
        self, flow_id: str, client: Any, req: GatewayRequest
    ) -> HttpAnswer | LiveAnswer | None:
        """Run one call with its own cancel, set when its connection closes, its stream resets or at shutdown."""
        cancel = req.disconnected = CallCancel()
        connection = client.id
        if client.timestamp_end is not None:  # already gone before its request reached us
            cancel.cancel()
        self._calls[flow_id] = cancel
        self._connections.setdefault(connection, set()).add(flow_id)
        answer: HttpAnswer | LiveAnswer | None = None
        try:
            answer = await self.gateway.handle(req) if self.gateway is not None else None
        finally:
            if isinstance(answer, LiveAnswer):  # it runs on: its cancel stays reachable until it ends
                answer.on_end(lambda: self._end_call(flow_id, connection))
            else:
                self._end_call(flow_id, connection)
        return answer

    def _end_call(self, flow_id: str, connection: str) -> None:
        self._calls.pop(flow_id, None)
        flows = self._connections.get(connection)
        if flows is not None:
            flows.discard(flow_id)

    async def _go_live(
        self, flow: http.HTTPFlow, answer: LiveAnswer | DeferredCall, *, keep_body: bool = False
    ) -> None:
        """Send the flow to the live server, which writes the answer as it is generated (see live_server.py)."""
        await self.live.start()
        token = self.live.register(answer)
        req = flow.request
        self._live_flows[flow.id] = (
            token,
            {
                "scheme": req.scheme,
                "host": req.host,
                "port": req.port,
                "path": req.path,
                "headers": req.headers.copy(),
                "raw_content": req.raw_content,
                "http_version": req.http_version,
            },
            answer,
        )
        req.scheme, req.host, req.port = "http", "127.0.0.1", self.live.port
        req.path = PATH_PREFIX + token
        if req.is_http2 or req.is_http3:  # the hop speaks HTTP/1.1, which wants a Host header
            req.http_version = "HTTP/1.1"
            req.headers["host"] = f"127.0.0.1:{self.live.port}"
        if keep_body:  # the hop reads the body itself (chunked, bounded)
            return
        # The answer is already planned (or refused): no need to copy the prompt over loopback.
        for name in ("content-encoding", "transfer-encoding"):
            req.headers.pop(name, None)
        req.headers["content-length"] = "0"
        req.raw_content = b""

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """A live answer's body is streamed to the harness chunk by chunk, as the live server writes it."""
        if flow.id in self._live_flows:
            flow.response.stream = True

    def response(self, flow: http.HTTPFlow) -> None:
        self._credentials.pop(flow.id, None)
        live = self._live_flows.pop(flow.id, None)
        if live is not None:
            _token, original, answer = live
            self._restore(flow, original)
            if answer.row is not None:  # saved with `mitmdump -w`, as for answers sent whole
                flow.metadata["polar_record"] = answer.row

    def error(self, flow: http.HTTPFlow) -> None:
        """A live flow that failed before its answer was fetched still gets its call run (and recorded)."""
        self._credentials.pop(flow.id, None)
        ident.scrub_credentials(flow.request.headers, flow.request.query)
        live = self._live_flows.pop(flow.id, None)
        if live is not None:
            token, original, _answer = live
            self.live.abandon(token)
            self._restore(flow, original)

    def client_disconnected(self, client) -> None:
        """Forget the connection; cancel its model calls still running (they are recorded `abort`)."""
        self._proxy_users.pop(client.id, None)
        for flow_id in self._connections.pop(client.id, set()):
            cancel = self._calls.get(flow_id)
            if cancel is not None:
                cancel.cancel()

    @staticmethod
    def _restore(flow: http.HTTPFlow, original: dict[str, Any]) -> None:
        """The request as the harness sent it (for `mitmdump -w` files and logs)."""
        req = flow.request
        req.scheme, req.host, req.port, req.path = (
            original["scheme"],
            original["host"],
            original["port"],
            original["path"],
        )
        req.headers = original["headers"]
        req.raw_content = original["raw_content"]
        req.http_version = original["http_version"]

    def _user_of(self, flow: http.HTTPFlow, credentials: ident.Credentials | None = None) -> str | None:
        auth = flow.metadata.get("proxyauth")  # set when mitmproxy's own proxyauth option is on
        if auth:
            return auth[0] or None
        header = flow.request.headers.get("Proxy-Authorization")
        if header is None and credentials is not None:
            header = credentials.header("proxy-authorization")
        return ident.proxy_user(header)

    def _gateway_request(self, flow: http.HTTPFlow, credentials: ident.Credentials) -> GatewayRequest:
        """The flow as the gateway sees it: credentials put back in (identity reads `polar-…` keys), text made
        UTF-8.

        Header and path bytes that are not UTF-8 reach us as lone surrogates, which no JSON encoder or Parquet
        column accepts: they become U+FFFD here, once.
        """
        safe = ident.safe_text
        user = self._user_of(flow, credentials) or self._proxy_users.get(flow.client_conn.id)
        # items(multi=True) reads the lines once; items() looks each name up again, over every line (quadratic).
        pairs = [*flow.request.headers.items(multi=True), *credentials.headers]
        headers = {safe(k).lower(): safe(v) for k, v in pairs}
        query = {safe(k): safe(v) for k, v in [*flow.request.query.items(), *credentials.query]}
        return GatewayRequest(
            method=safe(flow.request.method),
            host=safe(flow.request.pretty_host),
            path=safe(flow.request.path.split("?", 1)[0]),
            query=query,
            headers=headers,
            body=flow.request.raw_content or b"",
            content_encoding=safe(flow.request.headers.get("content-encoding", "")),
            mode="reverse" if isinstance(flow.client_conn.proxy_mode, ReverseMode) else "regular",
            proxy_user=safe(user) if user else None,
            connection_id=flow.client_conn.id[:12],
        )

    # -- shutdown ------------------------------------------------------------------------------------------------

    async def done(self) -> None:
        """SIGTERM: calls in flight run on for the grace period, then are aborted and recorded; then exit."""
        self.closing = True
        if self._engine_task is not None:
            self._engine_task.cancel()
        grace = self.options.shutdown_grace_seconds if self.options is not None else 0.0
        await self._wait_calls(grace)
        if self._handling or self.live.busy:
            log.warning(
                "shutting down: aborting %d call(s) still running after %.0f s of grace",
                len(self._handling) + self.live.busy,
                grace,
            )
            for cancel in list(self._calls.values()):
                cancel.cancel(SHUTDOWN)
            self.live.stop_all(SHUTDOWN)
            await self._wait_calls(ABORT_DRAIN_SECONDS + 2)
        if self.writer is not None:
            self.writer.close()
        if self.engine is not None:
            await self.engine.aclose()
        await self.live.close()

    async def _wait_calls(self, timeout: float) -> None:
        """Until no call runs (inline or live), or `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self._handling or self.live.busy) and loop.time() < deadline:
            await asyncio.sleep(0.05)


def body_framing(headers: Any) -> tuple[int | None, bool]:
    """(Content-Length if valid, whether the body is chunked) of a request's headers."""
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    try:
        length = int(headers.get("content-length", ""))
    except ValueError:
        length = None
    return (None if chunked or length is None or length < 0 else length), chunked


def drop_body(chunk: bytes) -> list[bytes]:
    """A refused body, read as it arrives and never kept (mitmproxy's `request.stream` callable)."""
    return []


def make_response(answer: HttpAnswer) -> http.Response:
    headers_out: dict[str, Any] = {"content-type": answer.content_type, **(answer.headers or {})}
    return http.Response.make(answer.status, answer.body, headers_out)


class DeferredCall:
    """A whole model call run behind the loopback hop (HTTP/2 flows), so a reset of its stream cancels it.

    mitmproxy pauses an HTTP/2 stream while an addon hook runs, and queues the stream's reset until the hook
    returns: a call answered inside `request` runs to its end for a client long gone. Behind the hop, mitmproxy
    is waiting on a server instead, and a reset closes that server connection.
    """

    def __init__(self, addon: PolarGateway, req: GatewayRequest, *, read_body: bool = False) -> None:
        self.addon, self.req, self.read_body = addon, req, read_body
        self.cancel = CallCancel()
        self.live: LiveAnswer | None = None
        self.row: dict[str, Any] | None = None

    def stop(self, reason: str) -> None:
        self.cancel.cancel(reason)
        if self.live is not None:
            self.live.stop(reason)

    async def run(self, out: Responder) -> None:
        if self.read_body:
            request = getattr(out, "request", None)
            if request is None:  # the client left before the hop was reached: nothing to read
                self.req.disconnected = self.cancel
                self.cancel.cancel()
            else:
                await self._read_body(request)
        if self.addon.gateway is None:
            answer: HttpAnswer | LiveAnswer | None = None
        else:
            self.req.disconnected = self.cancel
            answer = await self.addon.gateway.handle(self.req)
        if isinstance(answer, LiveAnswer):
            self.live = answer
            if self.cancel.is_set():
                answer.stop(self.cancel.reason)
            await answer.run(out)
            self.row = answer.row
            return
        if answer is None:  # cannot be forwarded from behind the hop: refused, as any unanswerable request
            answer = DEFAULT_CODEC.encode_error(
                GatewayError("internal", "polar-mitm: this request has no answer")
            )
        self.row = (answer.meta or {}).get("polar_record")
        try:
            await out.begin(
                answer.status,
                answer.content_type,
                {**(answer.headers or {}), "content-length": str(len(answer.body))},
            )
            await out.send(answer.body)
            await out.end()
        except (ConnectionError, OSError, RuntimeError):
            pass  # the client is gone; the call is recorded already

    async def _read_body(self, request: Any) -> None:
        """The body as it arrives over the hop, up to the gateway's limit (past it: refused, rest not read)."""
        limit = self.addon.gateway.config.max_body_bytes if self.addon.gateway is not None else 0
        body = bytearray()
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > limit:
                self.req.body_too_large = True
                body.clear()
                break
        self.req.body = bytes(body)
