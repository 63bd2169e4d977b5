"""Live streaming of one model call: the engine streams, the harness gets its provider's events as they arrive,
and the record written at the end holds what the non-streamed path would record.

Life of a live call: open the engine stream (`stream: true`, per-chunk logprobs, ids in the sglext chunk; an
engine that refuses answers in the provider's error shape) → commit the answer (HTTP 200 + the provider's opening
events) at the engine's first chunk, or at the first keep-alive tick if the engine is silent that long → each
engine chunk's deltas go out at once, coalesced when several wait → at the engine's end: the `Completion` built and
validated as in the non-streamed path, the chain advanced, the record appended durably, *then* the closing events.

A stream whose ids or logprobs do not add up still ends normally for the harness (it saw a good answer), but its
record is an error, never training data. When the harness goes away mid-stream the engine is told to abort
(`/abort_request`, SGLang's API), the rest of its stream is read for the ids sampled so far, and the call is
recorded as `abort` with those ids.

A stream that does not say its weight version (SGLang's, vLLM's) is labelled with the version read *before* the
engine was called; when the version read after the end differs (a push landed meanwhile, `--overlap`), the record
keeps the older label and its meta says `weight_version_after`, so the trainer counts the call as stale.

A call the *engine* ends with finish `abort` while the harness still reads (SGLang's weight update aborts running
requests by default) is resumed (engines/resume.py): prompt + the tokens sampled so far go back through the
token-in path with the rest of the budget, at most `MAX_RESUMES` times, and the harness's stream goes on with the
next token — never broken, never a token twice; one record joins the parts, a version span per part (a part whose
stream says no version is labelled with the version read at its first chunk: it waited out the update).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp
import orjson

from polar_mitm.codecs.base import Codec, GatewayError
from polar_mitm.codecs.live import Delta, LiveStream, StreamHead, live_stream
from polar_mitm.conversation import Completion, Conversation, ToolCall, harness_safe
from polar_mitm.engines.client import sse_frames
from polar_mitm.engines.dialects.base import version_change
from polar_mitm.engines.resume import MAX_RESUMES, ResumedText, continuation_request, seen_text
from polar_mitm.engines.stream import StreamAssembler
from polar_mitm.gateway.calls import ID_BYTES, CallContext, fill_record, offload
from polar_mitm.gateway.cancel import reason_of
from polar_mitm.gateway.prompts import PromptStep
from polar_mitm.storage.records import Record

log = logging.getLogger(__name__)

ABORT_DRAIN_SECONDS = 10.0  # after an abort, how long to wait for the engine's last chunk (the ids so far)


class Responder(Protocol):
    """Where a live answer goes (the transport): status line and headers once, then bytes as they come."""

    async def begin(self, status: int, content_type: str, headers: dict[str, str]) -> None: ...

    async def send(
        self, data: bytes
    ) -> None: ...  # raises ConnectionError (or OSError) when the client is gone

    async def end(self) -> None: ...


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


TICK, GONE, END = _Marker("TICK"), _Marker("GONE"), _Marker("END")  # keep-alive due, client gone, engine done


class _ClientGone(Exception):
    """The harness disconnected (its connection closed, or a write to it failed)."""


def live_engine_request(request: dict[str, Any], rid: str) -> None:
    """Turn the engine request into SGLang's streamed form: ids through sglext, usage at the end, our request id
    (so the call can be aborted by name). `return_token_ids`/`return_meta_info` are refused with `stream: true`."""
    request.pop("return_token_ids", None)
    request.pop("return_meta_info", None)
    request.update(
        stream=True,
        stream_options={"include_usage": True},
        return_input_ids_in_sglext=True,
        return_output_ids_in_sglext=True,
        rid=rid,
    )


class LiveAnswer:
    """A model call answered as it is generated; the transport calls `run` once with its responder."""

    def __init__(self, call: LiveCall) -> None:
        self.call = call
        self.request_id = call.record.request_id
        self._on_end: list[Callable[[], None]] = []

    def on_end(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the call has ended (recorded), however it ended."""
        self._on_end.append(callback)

    @property
    def row(self) -> dict[str, Any] | None:
        """The record, once written (before the last bytes go out): for the flow's metadata."""
        return self.call.row

    async def run(self, out: Responder) -> None:
        try:
            await self.call.run(out)
        finally:
            for callback in self._on_end:
                callback()

    def stop(self, reason: str) -> None:
        """End the call now (its stream reset, the gateway shutting down): recorded `abort` with `reason`."""
        self.call.stop(reason)


class LiveCall:
    """One streamed model call, from the engine request to the durable record."""

    def __init__(
        self,
        calls: CallContext,
        codec: Codec,
        conv: Conversation,
        record: Record,
        step: PromptStep,
        engine_body: bytes,
        disconnected: asyncio.Event | None,
        *,
        keepalive_seconds: float,
        prompt_tokens: int = 0,
    ) -> None:
        self.calls, self.codec, self.conv, self.record, self.step = calls, codec, conv, record, step
        self.engine_body, self.disconnected = engine_body, disconnected
        self.keepalive_seconds = keepalive_seconds
        self.prompt_tokens = prompt_tokens
        self.assembler = StreamAssembler()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.encoder: LiveStream | None = None
        self.out: Responder | None = None
        self.begun = False  # the provider's opening events are written (the answer is committed)
        self.headers_sent = False
        self.visible = False  # text or a tool call reached the harness (harness_safe's all-reasoning rule)
        self.offered = {tool.name for tool in conv.tools}
        self.row: dict[str, Any] | None = None
        self.stop_reason: str | None = None  # set by `stop`; else the disconnect event's reason
        self.version_before: str | None = None  # the engine's weight version when the call was sent
        self.rid = record.request_id  # the engine's name for the running part (a resumed part has its own)
        self.resumed: ResumedText | None = None  # parses a resumed part's raw text (None: the engine parses)
        # A resumed part of an engine whose streams say no version: its version is read at its first chunk.
        self._label_part = False

    # -- the whole call ----------------------------------------------------------------------------------------

    async def run(self, out: Responder) -> dict[str, Any]:
        """Stream the answer to `out`; returns the record row. Never raises."""
        self.out = out
        try:
            return await self._run()
        except GatewayError as err:
            return await self._after_error(err)
        except Exception as exc:  # a gateway bug: the harness still gets its provider's error shape
            log.exception("unexpected error in a live stream")
            return await self._after_error(GatewayError("internal", f"polar-mitm internal error: {exc!r}"))

    def stop(self, reason: str) -> None:
        """Abort the call as if its client had left, recording `reason`."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.queue.put_nowait(GONE)

    async def _after_error(self, err: GatewayError) -> dict[str, Any]:
        """The error answer and its record — unless the record is already written (one record per call)."""
        if self.row is not None:
            log.error(
                "live stream %s failed after its record was written: %s", self.record.request_id, err.message
            )
            await self._end()
            return self.row
        return await self._failed(err)

    async def _run(self) -> dict[str, Any]:
        if not self._streams_say_version():
            self.version_before = await self._weight_version()  # before the engine starts: a push may land
            self.assembler.part_version = self.version_before
        body = self.engine_body
        while True:  # one pass per part: more than one when the engine aborts the call and it is resumed
            async with self.calls.engine.open_stream(body) as resp:
                reader = asyncio.ensure_future(self._read(resp))
                watcher = asyncio.ensure_future(self._watch())
                try:
                    await self._pump()
                    resumed = await self._continuation()
                    if resumed is None:
                        return await self._finished()
                    body = resumed
                except _ClientGone:
                    return await self._aborted()
                finally:
                    watcher.cancel()
                    reader.cancel()

    def _streams_say_version(self) -> bool:
        return bool(getattr(self.calls.engine, "streams_say_version", False))

    async def _continuation(self) -> bytes | None:
        """The next part's engine body when the engine aborted the call on its own (and the budget is not
        spent); None when the call is over. GatewayError `engine_error` after `MAX_RESUMES` resumes."""
        sampled, prompt = self.assembler.sampled_ids, self.assembler.prompt_ids  # so far
        gone = self.stop_reason is not None or (self.disconnected is not None and self.disconnected.is_set())
        if self.assembler.finish_reason != "abort" or gone or self.assembler.output_ids is None or not prompt:
            return None
        if self.assembler.parts >= MAX_RESUMES:
            raise GatewayError(
                "engine_error",
                f"the engine aborted the call {MAX_RESUMES + 1} times ({len(sampled)} tokens sampled); "
                f"gave up after {MAX_RESUMES} resumes",
            )
        request = orjson.loads(self.engine_body)
        rid = f"{self.record.request_id}-resume{self.assembler.parts + 1}"
        body = continuation_request(request, prompt, sampled, rid=rid)
        if body is None:  # the abort came with the last token of the budget
            self.assembler.finish_reason = "length"
            return None
        assembler = self.assembler
        calls = len(assembler.calls)
        seen = seen_text(assembler.logprobs, "".join(assembler.reasoning), "".join(assembler.content), calls)
        self.resumed = ResumedText(request, await self.calls.engine.model_info(), seen, calls)
        assembler.begin_part(None)
        self._label_part = not self._streams_say_version()
        self.rid = rid
        log.info(
            "%s: the engine aborted the call after %d tokens; resuming", self.record.request_id, len(sampled)
        )
        return orjson.dumps(body)

    # -- reading the engine ------------------------------------------------------------------------------------

    async def _read(self, resp: aiohttp.ClientResponse) -> None:
        """Engine SSE → parsed chunks on the queue, then END (or the error that ended the stream)."""
        try:
            async for _event, data in sse_frames(resp):
                if data == b"[DONE]":
                    break
                chunk = await offload(
                    orjson.loads, len(data), data
                )  # the sglext ids of a long prompt: off the loop
                self.queue.put_nowait(chunk)
            self.queue.put_nowait(END)
        except ValueError as exc:
            self.queue.put_nowait(GatewayError("engine_error", f"the engine streamed malformed JSON: {exc}"))
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self.queue.put_nowait(GatewayError("engine_error", f"the engine's stream broke off: {exc!r}"))

    async def _watch(self) -> None:
        if self.disconnected is not None:
            await self.disconnected.wait()
            self.queue.put_nowait(GONE)

    async def _next_batch(self) -> list[Any]:
        """What the queue holds now (at least one item), or [TICK] when a keep-alive is due first."""
        if self.queue.empty():
            timeout = self.keepalive_seconds if self.keepalive_seconds > 0 else None
            try:
                first = await asyncio.wait_for(self.queue.get(), timeout)
            except TimeoutError:
                return [TICK]
        else:
            first = self.queue.get_nowait()
        batch = [first]
        while not self.queue.empty():
            batch.append(self.queue.get_nowait())
        return batch

    # -- writing the harness -----------------------------------------------------------------------------------

    async def _pump(self) -> None:
        """Engine chunks → provider events, until the engine's END (raises on errors and on a gone client)."""
        while True:
            data = bytearray()
            done = False
            for item in await self._next_batch():
                if item is TICK:
                    data += self._commit_bytes() + self._encoder().keepalive()
                elif item is GONE:
                    raise _ClientGone
                elif item is END:
                    done = True
                elif isinstance(item, GatewayError):
                    raise item
                else:
                    deltas = await self._feed(item)
                    data += self._commit_bytes()  # the engine's first chunk commits the answer
                    data += self._encode(deltas)
            await self._send(bytes(data))
            if done:
                return

    async def _feed(self, chunk: Any) -> list[Delta]:
        """One engine chunk into the assembler (a resumed part's raw text parsed first); the deltas it brings."""
        if self._label_part:  # a resumed part starts once the update it waited on is done: its version is now
            self._label_part = False
            self.assembler.part_version = await self._weight_version()
        if self.resumed is None:
            return self.assembler.feed(chunk)
        return [delta for piece in self.resumed.rewrite(chunk) for delta in self.assembler.feed(piece)]

    def _encoder(self) -> LiveStream:
        if self.encoder is None:
            # The engine's id when its first chunk is here; else ours (a keep-alive came first). The finished
            # completion takes the same id, so the record's response matches what the harness was sent.
            head_id = self.assembler.id or f"chatcmpl-{self.record.request_id.removeprefix('req_')}"
            self.encoder = live_stream(
                self.codec.name,
                self.conv,
                StreamHead(id=head_id, model=self.assembler.model, prompt_tokens=self.prompt_tokens),
            )
        return self.encoder

    def _commit_bytes(self) -> bytes:
        """The provider's opening events, the first time only."""
        if self.begun:
            return b""
        self.begun = True
        return self._encoder().start()

    async def _send(self, data: bytes) -> None:
        assert self.out is not None
        if self.begun and not self.headers_sent:
            self.headers_sent = True
            await self._begin(200, self._encoder().content_type)
        if not data:
            return
        try:
            await self.out.send(data)
        except (ConnectionError, OSError, aiohttp.ClientError) as exc:
            raise _ClientGone from exc

    async def _begin(self, status: int, content_type: str) -> None:
        assert self.out is not None
        try:
            await self.out.begin(
                status,
                content_type,
                {"cache-control": "no-cache", "x-polar-request-id": self.record.request_id},
            )
        except (ConnectionError, OSError) as exc:
            raise _ClientGone from exc

    def _encode(self, deltas: list[Delta]) -> bytes:
        encoder = self._encoder()
        return b"".join(encoder.delta(delta) for delta in self._checked(deltas))

    def _checked(self, deltas: list[Delta]) -> list[Delta]:
        """Tool calls the harness cannot run (a tool it does not offer, arguments that are not a JSON object) go
        out as the text the model wrote: `harness_safe`'s rule, the non-streamed path's, applied call by call."""
        checked = []
        for delta in deltas:
            if delta.kind == "tool_call" and delta.call is not None:
                shown = unrunnable_as_text(delta.call, self.offered)
                if shown is not None:
                    delta = Delta("text", ("\n" + shown) if self.visible else shown)
            if delta.kind != "reasoning":
                self.visible = True
            checked.append(delta)
        return checked

    # -- the three endings -------------------------------------------------------------------------------------

    async def _finished(self) -> dict[str, Any]:
        """The engine finished: validate, record durably, then send the closing events."""
        if not self.begun:  # not one chunk: there is no answer to close, only an error to give
            raise GatewayError("engine_error", "the engine's stream ended without any event")
        tail = self._encode(self.assembler.finish())
        try:
            completion = await offload(
                self.assembler.completion, len(self.assembler.input_ids or ()) * ID_BYTES
            )
            problem = None
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            completion, problem = self.assembler.display(), str(exc)
        if problem is None:
            await self._label_version(completion)
        completion.id = self._encoder().head.id
        completion.meta_json = orjson.dumps(completion.meta_info).decode()
        harness_safe(completion, [tool.name for tool in self.conv.tools])  # as the non-streamed path does
        if not self.visible and completion.content:  # all reasoning: shown as text, as the JSON answer does
            tail += self._encoder().delta(Delta("text", completion.content))
        record = self.record
        if problem is None:
            response = await offload(self._response_json, len(completion.prompt_ids) * ID_BYTES, completion)
            await self.calls.prompts.complete(self.step, completion)
            record.spliced_turns, record.splice_reason = self.step.spliced_turns, self.step.reason
            fill_record(record, self.conv, completion, response, 200)
        else:
            self.calls.abandon(self.step)
            record.error = f"engine_error: the streamed answer's ids/logprobs do not add up: {problem}"
            record.status_code = 200  # the harness got its answer; only the record is unusable
        row = self.row = await self.calls.persist(record)
        await self._send(tail + self._encoder().finish(completion))
        await self._end()
        return row

    async def _aborted(self) -> dict[str, Any]:
        """The harness left: abort the engine, read its last chunks for the ids so far, record `abort`."""
        self.calls.abandon(self.step)
        try:
            await self.calls.engine.abort_request(self.rid)
        except GatewayError as exc:  # an engine without /abort_request stops when the connection closes
            log.info("abort_request for %s: %s", self.rid, exc.message)
        completion = await self._drain()
        record = self.record
        if completion is not None:
            completion.id = self.assembler.id
            completion.meta_json = orjson.dumps(completion.meta_info).decode()
            fill_record(record, self.conv, completion, None, 499)
            sampled = f"after {completion.completion_tokens} sampled tokens (recorded)"
        else:
            sampled = "before its ids could be read"
        record.finish_reason, record.status_code = "abort", 499
        reason = self.stop_reason or reason_of(self.disconnected)
        record.error = f"abort: {reason} mid-stream; the engine generation was aborted {sampled}"
        row = self.row = await self.calls.persist(record)
        await self._end()
        return row

    async def _drain(self) -> Completion | None:
        """The rest of the engine's stream after an abort, for its sglext ids (None if they do not come)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ABORT_DRAIN_SECONDS
        while (left := deadline - loop.time()) > 0:
            try:
                item = await asyncio.wait_for(self.queue.get(), left)
            except TimeoutError:
                break
            if item is END:
                self.assembler.finish()
                try:
                    return self.assembler.completion()
                except (ValueError, KeyError, IndexError, TypeError):
                    return None
            if isinstance(item, GatewayError):
                return None
            if isinstance(item, dict):
                try:
                    await self._feed(item)
                except GatewayError:
                    return None
        return None

    async def _failed(self, err: GatewayError) -> dict[str, Any]:
        """An error: the provider's error answer (or in-stream error event once committed), recorded."""
        self.calls.abandon(self.step)
        record = self.record
        record.error = f"{err.kind}: {err.message}"
        try:
            if self.begun:
                record.status_code = 200
                await self._send(self._encoder().fail(err))
            else:
                answer = self.codec.encode_error(err)
                record.status_code = answer.status
                await self._begin(answer.status, answer.content_type)
                assert self.out is not None
                await self.out.send(answer.body)
        except _ClientGone:
            pass
        row = self.row = await self.calls.persist(record)
        await self._end()
        return row

    async def _end(self) -> None:
        assert self.out is not None
        try:
            await self.out.end()
        except (ConnectionError, OSError):
            pass

    # -- helpers -----------------------------------------------------------------------------------------------

    def _response_json(self, completion: Completion) -> str:
        return orjson.dumps(self.codec.encode_response(self.conv, completion)).decode()

    async def _label_version(self, completion: Completion) -> None:
        """The weight version the call ran under: the stream's own, else the one read before it (and the one read
        now as well, when a push changed it during the call)."""
        engine = self.calls.engine
        if completion.weight_version is not None:
            if hasattr(engine, "streams_say_version"):
                engine.streams_say_version = (
                    True  # this engine's streams say it: no read before the next call
                )
            return
        after = await self._weight_version()
        completion.weight_version = self.version_before
        spans = completion.meta_info.get("version_spans") or [{"version": self.version_before}]
        completion.meta_info.update(version_change(spans[-1]["version"], after))

    async def _weight_version(self) -> str | None:
        """SGLang's streamed chunks do not carry the weight version: ask the engine (weights change between RL
        iterations, while no call runs)."""
        try:
            return await self.calls.engine.weight_version()
        except GatewayError:
            return None


def unrunnable_as_text(call: ToolCall, offered: set[str]) -> str | None:
    """The text `harness_safe` shows in place of `call` when the harness cannot run it; None when it can."""
    alone = Completion(
        id="",
        model="",
        content="",
        reasoning=None,
        tool_calls=[call],
        finish_reason="tool_calls",
        prompt_ids=[],
        completion_ids=[],
        completion_logprobs=[],
    )
    harness_safe(alone, offered)
    return None if alone.tool_calls else alone.content
