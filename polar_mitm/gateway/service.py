"""The gateway's request handling, independent of mitmproxy: request in → provider answer out + one record.

Life of a model call: resolve identity → detect the provider → decode the body (content encoding, JSON; worker
thread) → ask the engine (async HTTP, cancelled when the harness disconnects) → encode the provider answer, JSON or
SSE replay (worker thread) → append the record durably → answer the harness. A call the harness streams goes live
instead (`polar_stream=live`, gateway/live.py): the engine streams and the harness gets events as tokens are sampled.
Nothing here blocks the event loop:
JSON work of prompt-sized payloads runs in threads. Every failure, expected or not, is answered in the provider's
own error shape and recorded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from polar_mitm.codecs import DEFAULT_CODEC, by_path, detect, provider_for, websocket_codec
from polar_mitm.codecs.base import Codec, GatewayError, HttpAnswer
from polar_mitm.codecs.common import parse_body
from polar_mitm.conversation import Completion, Conversation, harness_safe
from polar_mitm.engines.client import EngineClient
from polar_mitm.engines.resume import MAX_RESUMES, continuation_request, joined_answer
from polar_mitm.gateway import identity as ident
from polar_mitm.gateway.call_kind import call_kind
from polar_mitm.gateway.calls import OFFLOAD_BYTES, CallContext, fill_record, offload
from polar_mitm.gateway.cancel import reason_of
from polar_mitm.gateway.content import decode_content, too_large
from polar_mitm.gateway.live import LiveAnswer, LiveCall, live_engine_request
from polar_mitm.gateway.options import GatewayOptions
from polar_mitm.gateway.prompts import PromptBuilder, PromptStep
from polar_mitm.storage.journal import RecordWriter
from polar_mitm.storage.records import Record

ABORTED = b'"abort"'  # an aborted whole answer's finish_reason value, however its JSON is spaced
log = logging.getLogger(__name__)

READY_PATH = "/_polar/ready"  # the readiness answer (`gateway.processes.start_gateway` waits on it)


@dataclass
class GatewayRequest:
    method: str
    host: str
    path: str  # without the query string
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: bytes
    mode: str  # regular | reverse
    proxy_user: str | None
    connection_id: str
    content_encoding: str = ""  # of `body`; decoded by the gateway, off the event loop
    disconnected: asyncio.Event | None = None  # set when the harness's connection closes
    body_too_large: bool = (
        False  # refused at its headers (Content-Length) or as it arrived; `body` is not all
    )


class ClientDisconnected(Exception):
    """The harness closed its connection before its answer was ready."""


class Gateway:
    """Answers model calls from the engine and records them; answers or blocks everything else."""

    def __init__(
        self,
        config: GatewayOptions,
        engine: EngineClient,
        writer: RecordWriter,
        prompts: PromptBuilder | None = None,
        *,
        session_key: str | None = None,
    ) -> None:
        self.config, self.engine, self.writer = config, engine, writer
        self.session_key = session_key  # a rollout's gateway: only calls with a valid session credential
        self.prompts = prompts or PromptBuilder("messages")
        self.calls = CallContext(engine, self.prompts, writer)
        self._seq: dict[str, itertools.count] = defaultdict(lambda: itertools.count(0))

    def seed_sequences(self, last_seq: dict[str, int]) -> None:
        """Continue per-session numbering after a restart."""
        for session, seq in last_seq.items():
            self._seq[session] = itertools.count(seq + 1)

    def continue_numbering(self, previous: Gateway) -> None:
        """Number sessions on from where `previous` is (the gateway it replaces, same records folder)."""
        self._seq = previous._seq

    # -- entry point ---------------------------------------------------------------------------------------------

    async def handle(self, req: GatewayRequest) -> HttpAnswer | LiveAnswer | None:
        """The answer for `req`, or None to let it go upstream (passthrough of non-model traffic).

        A streamed model call in `live` mode is a LiveAnswer: the transport runs it, and it writes as it goes.

        Never raises: an unexpected failure is answered in the provider's error shape and recorded.
        """
        try:
            return await self._route(req)
        except Exception as exc:  # a gateway bug must not cost the harness its provider's error shape
            log.exception("unexpected error on %s %s", req.method, req.path)
            return await self._internal_error(req, exc)

    async def _route(self, req: GatewayRequest) -> HttpAnswer | LiveAnswer | None:
        try:
            who, path = self._identity(req)
        except ident.SessionRefused as refused:
            return self._refused(req, refused)
        if req.headers.get("upgrade", "").lower() == "websocket":
            return self._no_websocket(req, path)
        if req.method == "GET" and path == READY_PATH:
            return self.readiness_answer()
        if req.method == "POST":
            codec = by_path(path)
            if codec is not None:  # the common case: decided by the path alone, body parsed off the loop
                return await self._model_call(req, who, path, codec)
        provider = self._provider_for(req, path)
        if provider is not None and req.method == "POST" and provider.count_tokens_path(path):
            return await self._count_tokens(req, who, path, provider)
        if provider is not None and req.method == "GET" and provider.models_path(path, req.method):
            return await self._models(path, provider)
        codec = await self._detect(req, path) if req.method == "POST" else None
        if codec is not None:  # a body that looks like a model call on an unknown path
            return await self._model_call(req, who, path, codec)
        if req.method == "HEAD" and path in ("", "/"):
            return HttpAnswer(200, b"", "text/plain")
        if provider is None and req.mode == "regular" and self.config.passthrough == "upstream":
            return None
        shape = provider or DEFAULT_CODEC
        return shape.encode_error(
            GatewayError(
                "not_found",
                f"polar-mitm: {req.method} {req.host}{path} is not a model call; this gateway only "
                f"serves model APIs (set polar_passthrough=upstream to forward other traffic)",
            )
        )

    def readiness_answer(self) -> HttpAnswer:
        """`GET /_polar/ready`: 200 once a model call would not wait for anything to load, else 503 (see
        PromptBuilder.readiness); runners wait on it instead of sending calls into a loading gateway."""
        ready, detail = self.prompts.readiness()
        body = orjson.dumps({"ready": ready, "prompt_mode": self.prompts.mode, "detail": detail})
        return HttpAnswer(200 if ready else 503, body, "application/json")

    async def _detect(self, req: GatewayRequest, path: str) -> Codec | None:
        """The codec of a POST whose path is unknown, by its headers and body shape (None if not a model call)."""
        try:
            body = parse_body(await self._body(req))
        except GatewayError:
            return None  # not a readable JSON body, so not a model call: answered as other traffic
        return detect(path, req.headers, body)

    async def _body(self, req: GatewayRequest) -> bytes:
        """The request body, content encoding decoded (once), within the size limit; else a GatewayError."""
        limit = self.config.max_body_bytes
        if req.body_too_large or len(req.body) > limit:
            raise too_large(limit)
        if req.content_encoding and req.content_encoding.lower() != "identity":
            req.body = await offload(decode_content, len(req.body), req.body, req.content_encoding, limit)
            req.content_encoding = ""
        return req.body

    def _no_websocket(self, req: GatewayRequest, path: str) -> HttpAnswer:
        """Model APIs are served over plain HTTP here; a WebSocket upgrade gets an answer that ends retries.

        Codex opens the Responses API as a WebSocket first (`wss://…/v1/responses`); a 404 makes it retry five
        times with backoff (~6 s) before it falls back to HTTPS, HTTP 426 makes it fall back at once.
        """
        shape = self._provider_for(req, path) or websocket_codec()
        answer = shape.encode_error(
            GatewayError(
                "not_found", "polar-mitm: WebSocket transport is not supported; use HTTPS (streaming SSE)"
            )
        )
        answer.status = 426
        return answer

    @staticmethod
    def _provider_for(req: GatewayRequest, path: str) -> Codec | None:
        """The provider of a request that is not (known to be) a model call; None when nothing tells."""
        return provider_for(req.host, req.headers, path, reverse=req.mode == "reverse")

    # -- auxiliary endpoints -------------------------------------------------------------------------------------

    async def _count_tokens(
        self, req: GatewayRequest, who: ident.Identity, path: str, codec: Codec
    ) -> HttpAnswer:
        """Anthropic count_tokens / Google countTokens, counted by the engine's tokenizer; failures recorded."""
        try:
            raw = await self._body(req)
            conv: Conversation = await offload(
                self._decode_count_tokens, len(raw), codec, raw, path, req.query
            )
            n = await self.engine.count_tokens(
                [m.to_engine() for m in conv.messages], [t.to_engine() for t in conv.tools]
            )
        except GatewayError as err:
            answer = codec.encode_error(err)
            record = self._new_record(req, who, path, codec)
            record.error, record.status_code = f"{err.kind}: {err.message}", answer.status
            return with_record(answer, await self._persist(record))
        return HttpAnswer.json(200, codec.encode_count_tokens(n))

    @staticmethod
    def _decode_count_tokens(codec: Codec, raw: bytes, path: str, query: dict[str, str]) -> Conversation:
        return codec.decode_count_tokens(parse_body(raw), path, query)

    async def _models(self, path: str, codec: Codec) -> HttpAnswer:
        """Model listings and lookups, answered locally with the engine's served model."""
        try:
            served = await self.engine.served_model()
        except GatewayError as err:
            return codec.encode_error(err)
        tail = path.rstrip("/").rsplit("/", 1)[-1]
        ids = [tail] if tail not in ("models",) else [served, *self.config.models]
        return HttpAnswer.json(200, codec.encode_models(ids, path))

    async def _internal_error(self, req: GatewayRequest, exc: Exception) -> HttpAnswer:
        """A gateway bug, answered as a provider-shaped 500 and recorded (the record is skipped if that fails too)."""
        path = ident.strip_path_prefix(req.path)[0]
        codec = self._shape_for(req, path)
        answer = codec.encode_error(GatewayError("internal", f"polar-mitm internal error: {exc!r}"))
        try:
            who = self._identity(req)[0]
        except Exception:  # the identity itself may be what failed: record under the connection's id
            log.exception("identity unresolvable for the internal-error record")
            who = ident.Identity(session_id=f"conn-{req.connection_id}", task_id=None, source="connection")
        try:
            record = self._new_record(req, who, path, codec)
            record.error, record.status_code = f"internal: {exc!r}", answer.status
            return with_record(answer, await self._persist(record))
        except Exception:
            log.exception("could not record the internal error on %s %s", req.method, req.path)
            return answer

    def _identity(self, req: GatewayRequest) -> tuple[ident.Identity, str]:
        return ident.resolve(
            req.headers,
            req.path,
            req.query,
            proxy_user_name=req.proxy_user,
            connection_id=req.connection_id,
            session_key=self.session_key,
        )

    def _refused(self, req: GatewayRequest, refused: ident.SessionRefused) -> HttpAnswer:
        """A call without a valid session credential: 401 in its provider's shape, nothing recorded (readiness
        polls still answered: they carry no session)."""
        path = ident.strip_path_prefix(req.path)[0]
        if req.method == "GET" and path == READY_PATH:
            return self.readiness_answer()
        log.warning("refused %s %s: no valid session credential", req.method, path[:200])
        return self._shape_for(req, path).encode_error(GatewayError("unauthenticated", str(refused)))

    def _shape_for(self, req: GatewayRequest, path: str) -> Codec:
        """The provider whose error shape suits `req` (OpenAI's when nothing tells): never raises."""
        try:
            return by_path(path) or self._provider_for(req, path) or DEFAULT_CODEC
        except Exception:
            return DEFAULT_CODEC

    # -- model calls ---------------------------------------------------------------------------------------------

    async def _model_call(
        self, req: GatewayRequest, who: ident.Identity, path: str, codec: Codec
    ) -> HttpAnswer | LiveAnswer:
        record = self._new_record(req, who, path, codec)
        step: PromptStep | None = None
        try:
            raw_body = await self._body(req)
            record.request_json = raw_body.decode("utf-8", "replace") or None
            conv, engine_request = await offload(
                self._prepare, len(raw_body), codec, raw_body, path, req.query
            )
            record.stream, record.model_requested = conv.stream, conv.model
            record.call_kind = call_kind(conv, path)
            record.output_constraint = (conv.response_format or {}).get("type")
            # orjson writes a dataclass as `asdict` would, without copying it first (0.3 ms a call at 1k tokens)
            record.messages_json = orjson.dumps(conv.messages).decode()
            record.tools_json = orjson.dumps(conv.tools).decode()
            live = conv.stream and self.config.stream == "live"
            if live:  # the engine streams too; the harness gets tokens as they are sampled
                live_engine_request(engine_request, record.request_id)
            else:  # our request id, as a live call's: the engine's log and stats name the call as the record does
                engine_request["rid"] = record.request_id
            # tokens mode: the session's exact token stream + the new tail as input_ids (gateway/prompts.py)
            # (a compaction's commit marks the session for the next main call's new chain, replay and live alike)
            step, engine_body = await self.prompts.prepare(
                who.session_id,
                conv,
                engine_request,
                record.call_kind,
                inline=len(raw_body) < OFFLOAD_BYTES,
            )
            record.prompt_mode, record.splice_reason = step.mode, step.reason
            if live:
                return LiveAnswer(
                    LiveCall(
                        self.calls,
                        codec,
                        conv,
                        record,
                        step,
                        engine_body,
                        req.disconnected,
                        keepalive_seconds=self.config.keepalive_seconds,
                        prompt_tokens=len(engine_request.get("input_ids") or ()),
                    )
                )
            raw = await self._ask_engine(engine_body, req.disconnected)
            if (
                ABORTED in raw
            ):  # a byte search: a whole answer is parsed once, in _finish, unless it was aborted
                raw = await self._resumed(raw, engine_body, record.request_id, req.disconnected)
            answer, completion, response = await offload(
                self._finish, len(raw), codec, conv, raw, step.sent_ids()
            )
            await self.prompts.complete(step, completion)
            record.spliced_turns, record.splice_reason = step.spliced_turns, step.reason
        except ClientDisconnected:
            self._abandon(step)
            record.finish_reason, record.status_code = "abort", 499
            record.error = (
                f"abort: {reason_of(req.disconnected)} before the answer; the engine call was cancelled"
            )
            return with_record(HttpAnswer(499, b"", "text/plain"), await self._persist(record))
        except GatewayError as err:
            self._abandon(step)
            answer = codec.encode_error(err)
            record.error = f"{err.kind}: {err.message}"
            record.status_code = answer.status
            return with_record(answer, await self._persist(record))
        except Exception as exc:  # never crash on a bad flow: report it in the provider's shape
            self._abandon(step)
            log.exception("unexpected error on %s %s", req.method, path)
            err = GatewayError("internal", f"polar-mitm internal error: {exc!r}")
            answer = codec.encode_error(err)
            record.error, record.status_code = f"internal: {exc!r}", answer.status
            return with_record(answer, await self._persist(record))
        fill_record(record, conv, completion, response, answer.status)
        return with_record(answer, await self._persist(record))

    def _abandon(self, step: PromptStep | None) -> None:
        self.calls.abandon(step)

    def _new_record(self, req: GatewayRequest, who: ident.Identity, path: str, codec: Codec) -> Record:
        """The record of a call, as an error until an answer fills it in (takes the session's next seq)."""
        started = datetime.now(UTC)
        return Record(
            request_id=f"req_{uuid.uuid4().hex}",
            session_id=who.session_id,
            task_id=who.task_id,
            seq=next(self._seq[who.session_id]),
            started_at=started,
            finished_at=started,
            provider=codec.name,
            path=path,
            host=req.host,
            mode=req.mode,
            stream=False,
            finish_reason="error",
            session_source=who.source,
            harness_ids_json=orjson.dumps(who.harness_ids).decode() if who.harness_ids else None,
        )

    async def _ask_engine(self, engine_body: bytes, disconnected: asyncio.Event | None) -> bytes:
        """The engine's raw answer; if the harness disconnects first, the engine call is cancelled.

        Cancelling closes the engine connection, and SGLang and `polar-mitm serve` both stop decoding when their
        client goes away: an abandoned generation does not hold the engine for the next caller.
        """
        if disconnected is None:
            return await self.engine.chat(engine_body)
        call = asyncio.ensure_future(self.engine.chat(engine_body))
        gone = asyncio.ensure_future(disconnected.wait())
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not call.done():
                call.cancel()
                await asyncio.wait({call})  # let aiohttp close the connection before the abort is recorded
        if call.cancelled():
            raise ClientDisconnected
        return call.result()

    async def _resumed(
        self, raw: bytes, engine_body: bytes, request_id: str, disconnected: asyncio.Event | None
    ) -> bytes:
        """A whole answer the engine aborted on its own (SGLang's weight update aborts running requests by
        default), resumed as a live call is (engines/resume.py): prompt + the tokens sampled so far go back with the
        rest of the budget, at most MAX_RESUMES times, and the parts are joined into one answer before the harness
        sees any of it. GatewayError `engine_error` after MAX_RESUMES resumes."""
        try:
            answer = orjson.loads(raw)
            if answer["choices"][0].get("finish_reason") != "abort":
                return raw
            request = orjson.loads(engine_body)
            for part in range(1, MAX_RESUMES + 2):
                choice = answer["choices"][0]
                if choice.get("finish_reason") != "abort":
                    break
                sampled = choice["response_token_ids"]
                if part > MAX_RESUMES:
                    raise GatewayError(
                        "engine_error",
                        f"the engine aborted the call {part} times ({len(sampled)} tokens sampled); "
                        f"gave up after {MAX_RESUMES} resumes",
                    )
                body = continuation_request(
                    request, choice["prompt_token_ids"], sampled, rid=f"{request_id}-resume{part}"
                )
                if body is None:  # the abort came with the last token of the budget
                    choice["finish_reason"] = "length"
                    break
                log.info(
                    "%s: the engine aborted the call after %d tokens; resuming", request_id, len(sampled)
                )
                rest = orjson.loads(await self._ask_engine(orjson.dumps(body), disconnected))
                answer = joined_answer(answer, rest, request, await self.engine.model_info())
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise GatewayError(
                "engine_error", f"the engine's aborted answer cannot be resumed: {exc!r}"
            ) from exc
        return orjson.dumps(answer)

    def _prepare(
        self, codec: Codec, raw: bytes, path: str, query: dict[str, str]
    ) -> tuple[Conversation, dict[str, Any]]:
        body = parse_body(raw)
        conv = codec.decode_request(body, path, query)
        if conv.stream is False:
            conv.stream = codec.stream_requested(body, path, query)
        overrides: dict[str, Any] = {"temperature": self.config.temperature, "top_p": self.config.top_p}
        cap = self.config.completion_cap
        if cap is not None:
            overrides["max_tokens"] = min(conv.max_tokens or cap, cap)
        request = conv.to_engine_request(overrides=overrides)
        conv.sampling = explicit_sampling(request)
        return conv, request

    @staticmethod
    def _finish(
        codec: Codec, conv: Conversation, raw: bytes, sent: tuple[list[int] | None, bytes | None]
    ) -> tuple[HttpAnswer, Completion, str]:
        try:
            completion = Completion.from_engine_answer(raw, *sent)
            completion.meta_json = orjson.dumps(completion.meta_info).decode()
            harness_safe(completion, [t.name for t in conv.tools])  # malformed model output → text
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise GatewayError("engine_error", f"the engine's answer is unusable: {exc}") from exc
        response = codec.encode_response(conv, completion)
        response_text = orjson.dumps(response).decode()
        if conv.stream:
            answer = HttpAnswer(
                200,
                b"".join(codec.encode_stream(conv, completion)),
                "text/event-stream",
                {"cache-control": "no-cache"},
            )
        else:
            answer = HttpAnswer(200, response_text.encode(), "application/json")
        return answer, completion, response_text

    async def _persist(self, record: Record) -> dict[str, Any]:
        """Append the record durably; return its journal row."""
        return await self.calls.persist(record)


# What SGLang samples with when a field is absent *and* it runs with `--sampling-defaults openai`. With its
# default `--sampling-defaults model` it would take the model's generation_config.json instead — so the gateway
# always sends every field explicitly, and the record's values are the ones the engine used.
# repetition_penalty is never recorded: it is pinned to neutral so a generation_config value cannot slip in.
NEUTRAL_SAMPLING: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def explicit_sampling(request: dict[str, Any]) -> dict[str, Any]:
    """Fill every sampling field of an engine request with its explicit value; return those values."""
    for key, neutral in NEUTRAL_SAMPLING.items():
        if request.get(key) is None:
            request[key] = neutral
    return {key: request[key] for key in NEUTRAL_SAMPLING}


def with_record(answer: HttpAnswer, row: dict[str, Any]) -> HttpAnswer:
    """Tag the answer with its record: a response header, and the row itself for the flow's metadata."""
    answer.headers = {**(answer.headers or {}), "x-polar-request-id": row["request_id"]}
    answer.meta = {"polar_record": row}
    return answer
