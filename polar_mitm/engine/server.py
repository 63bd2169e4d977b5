"""The embedded engine's HTTP server: the subset of SGLang's API the gateway and the RL loop use.

Endpoints: POST /v1/chat/completions, POST /generate, POST /tokenize, POST /update_weights_from_disk,
POST /abort_request, GET /model_info, GET /health, GET /v1/models, and (ours) GET /engine_stats. Errors are
SGLang-like JSON (`{"object": "error", ...}`) with HTTP 400 for bad input; generation runs in worker threads so the
event loop keeps answering while a long prompt prefills, and streamed tokens are sent while the next is decoded.

Every route but /health needs the engine's API key (`engine_keys.KeyGuard`), and a weight push must carry a label
this engine has never served: records are labelled by it, so weights pushed under a served label would pass as
the weights that label names. A push lands between two tokens of the running generation (`on_push="swap"`), or
aborts it as SGLang does by default (`"abort"`, `polar-mitm serve --on-push abort`; per push: SGLang's
`abort_all_requests` field), which is how the gateway's resume of an aborted call is tested for real.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from polar_mitm.codecs.common import SSE_DONE, sse_event
from polar_mitm.engine import chat
from polar_mitm.engine.generation import ContextOverflow, Engine, Generation, TokenStep
from polar_mitm.engine.parsers import TextStreamParser
from polar_mitm.engine.sampling import SamplingError, SamplingParams
from polar_mitm.engine.streaming import IncrementalDecoder, IncrementalText
from polar_mitm.engines.keys import KeyGuard

BAD_INPUT = (chat.ChatRequestError, SamplingError, ContextOverflow)
ON_PUSH = ("swap", "abort")  # what a weight push does to a running generation (see the module docstring)


def error_response(message: str, status: int = 400, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status},
        status_code=status,
    )


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise chat.ChatRequestError(f"malformed JSON body: {exc}") from exc


@dataclass
class Pacing:
    """Test knob: slow the engine down to a known pace (seconds), so tests can observe streaming and aborts.

    `first_token_delay` holds the first token back (a long prefill); `token_delay` every token after it. Both
    waits end at once when the generation is cancelled.
    """

    token_delay: float = 0.0
    first_token_delay: float = 0.0

    def wrap(
        self, on_token: Callable[[TokenStep], None] | None, cancelled: threading.Event
    ) -> Callable[[TokenStep], None] | None:
        if not (self.token_delay or self.first_token_delay):
            return on_token
        sent = [0]

        def paced(step: TokenStep) -> None:
            cancelled.wait(self.first_token_delay if sent[0] == 0 else self.token_delay)
            sent[0] += 1
            if on_token is not None:
                on_token(step)

        return paced


@dataclass
class EngineStats:
    """What the engine did (GET /engine_stats): lets tests see that an abandoned generation really stopped."""

    started: int = 0
    finished: int = 0
    aborted: int = 0
    running: dict[str, int] = field(default_factory=dict)  # request id → tokens sampled so far
    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # finished generations, newest last
    tokens_by_version: dict[str, int] = field(default_factory=dict)  # sampled tokens per weight version

    def as_json(self) -> dict[str, Any]:
        return {
            "started": self.started,
            "finished": self.finished,
            "aborted": self.aborted,
            "running": dict(self.running),
            "recent": list(self.recent),
            "tokens_by_version": dict(self.tokens_by_version),
        }


class EngineServer:
    """Routes bound to one Engine."""

    def __init__(
        self,
        engine: Engine,
        pacing: Pacing | None = None,
        *,
        stream_weight_version: bool = True,
        on_push: str = "swap",
    ) -> None:
        self.engine = engine
        self.pacing = pacing or Pacing()
        self.stream_weight_version = stream_weight_version  # False: streams say no version, as SGLang's
        self.on_push = on_push
        self.stats = EngineStats()
        self._cancels: dict[
            str, threading.Event
        ] = {}  # running request id → its cancel flag (/abort_request)
        self.served_versions = {engine.weight_version}  # a push must bring a label not among these

    # -- helpers -------------------------------------------------------------------------------------------------

    def _tracked(
        self,
        request_id: str,
        run: Callable[[threading.Event, Callable[[TokenStep], None] | None], Generation],
    ) -> Callable[..., Generation]:
        """`run` with its cancel flag registered under `request_id`, paced, and counted in the stats.

        Runs in the worker thread; the stats are only touched there and read whole by /engine_stats.
        """

        def tracked(
            cancelled: threading.Event, on_token: Callable[[TokenStep], None] | None = None
        ) -> Generation:
            stats = self.stats
            self._cancels[request_id] = cancelled
            stats.started += 1
            stats.running[request_id] = 0

            def counted(step: TokenStep) -> None:
                stats.running[request_id] = stats.running.get(request_id, 0) + 1
                version = str(step.weight_version)
                stats.tokens_by_version[version] = stats.tokens_by_version.get(version, 0) + 1
                if on_token is not None:
                    on_token(step)

            gen: Generation | None = None
            try:
                gen = run(cancelled, self.pacing.wrap(counted, cancelled))
                return gen
            finally:
                self._cancels.pop(request_id, None)
                stats.running.pop(request_id, None)
                kind = ((gen.finish_reason or {}).get("type") if gen is not None else "error") or "stop"
                if kind == "abort":
                    stats.aborted += 1
                else:
                    stats.finished += 1
                stats.recent.append(
                    {
                        "request_id": request_id,
                        "finish_reason": kind,
                        "completion_tokens": len(gen.output_ids) if gen is not None else 0,
                    }
                )

        return tracked

    async def _run_generation(
        self, request: Request, run: Callable[[threading.Event], Generation]
    ) -> Generation:
        """Generate in a worker thread; a client disconnect sets the cancel flag, which stops decoding."""
        cancelled = threading.Event()
        task = asyncio.get_running_loop().run_in_executor(None, run, cancelled)

        async def watch() -> None:
            while not task.done():
                if await request.is_disconnected():
                    cancelled.set()
                    return
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            return await task
        finally:
            watcher.cancel()

    def _stream_steps(self, run: Callable[[threading.Event, Callable[[TokenStep], None]], Generation]):
        """Start a generation in a thread; return (queue of steps then the final Generation or exception, cancel)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def worker() -> None:
            try:
                gen = run(cancelled, lambda step: loop.call_soon_threadsafe(queue.put_nowait, step))
                loop.call_soon_threadsafe(queue.put_nowait, gen)
            except BaseException as exc:  # handed to the streaming coroutine, which reports it
                loop.call_soon_threadsafe(queue.put_nowait, exc)

        threading.Thread(target=worker, daemon=True).start()
        return queue, cancelled

    # -- endpoints -----------------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def engine_stats(self, request: Request) -> Response:
        """Generations started, finished, aborted and running (with tokens sampled so far)."""
        return JSONResponse(self.stats.as_json())

    async def abort_request(self, request: Request) -> Response:
        """SGLang's `POST /abort_request {"rid": ...}` (or `{"abort_all": true}`): stop those generations.

        A streamed generation then ends with `finish_reason: abort` and its final sglext chunk (the ids so far).
        """
        try:
            body = await read_json(request)
        except BAD_INPUT as exc:
            return error_response(str(exc))
        body = body if isinstance(body, dict) else {}
        targets = list(self._cancels) if body.get("abort_all") else [body.get("rid")]
        for rid in targets:
            cancel = self._cancels.get(rid) if isinstance(rid, str) else None
            if cancel is not None:
                cancel.set()
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        e = self.engine
        return JSONResponse(
            {
                "model_path": str(e.model_path),
                "tokenizer_path": str(e.model_path),
                "is_generation": True,
                "served_model_name": e.served_model_name,
                "weight_version": e.weight_version,
                "context_length": e.context_length,
                "tool_call_parser": e.tool_call_parser,
                "reasoning_parser": e.reasoning_parser,
                "eos_token_ids": sorted(e.eos_ids),
                "engine": "polar-mitm-embedded",
                "model_meta": e.model_meta,
            }
        )

    async def models(self, request: Request) -> Response:
        e = self.engine
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": e.served_model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "sglang",
                        "root": str(e.model_path),
                        "max_model_len": e.context_length,
                    }
                ],
            }
        )

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise chat.ChatRequestError("request body must be a JSON object")
            tok = self.engine.tokenizer
            if body.get("messages") is not None:
                ids = tok.apply_chat_template(
                    chat.normalise_messages(body["messages"]),
                    tools=body.get("tools"),
                    add_generation_prompt=body.get("add_generation_prompt", True),
                    tokenize=True,
                    return_dict=False,
                    **(body.get("chat_template_kwargs") or {}),
                )
            elif isinstance(body.get("prompt"), str):
                ids = tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", False))
            else:
                raise chat.ChatRequestError("give `prompt` (a string) or `messages`")
        except BAD_INPUT as exc:
            return error_response(str(exc))
        return JSONResponse(
            {"tokens": list(ids), "count": len(ids), "max_model_len": self.engine.context_length}
        )

    def _push_label(self, asked: Any) -> str:
        """The label a push gets: the one asked for, else one past the current; never one served before."""
        current = self.engine.weight_version
        if asked is None or asked == "":
            label = str(int(current) + 1) if current.isdigit() else f"{current}+1"
        else:
            label = str(asked)
        if label in self.served_versions:
            raise chat.ChatRequestError(
                f"weight_version {label!r} was already served by this engine: a push must carry a new label"
            )
        return label

    async def update_weights_from_disk(self, request: Request) -> Response:
        try:
            body = await read_json(request)
            path = body.get("model_path") if isinstance(body, dict) else None
            if not path:
                raise chat.ChatRequestError("model_path is required")
            label = self._push_label(body.get("weight_version"))
            abort = body.get("abort_all_requests", self.on_push == "abort")
        except BAD_INPUT as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        try:
            version = await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.engine.update_weights_from_disk(path, label, abort_running=bool(abort))
            )
        except Exception as exc:  # a bad checkpoint must not take the server down
            return JSONResponse(
                {"success": False, "message": f"Failed to update weights: {exc}"}, status_code=400
            )
        self.served_versions.add(version)
        return JSONResponse(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "weight_version": version,
                "num_paused_requests": 0,
                "on_push": "abort" if abort else "swap",
                "pause_seconds": self.engine.last_push_pause,  # the running generation's stall (its re-prefill)
            }
        )

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await read_json(request)
            job = chat.build_job(self.engine, body)
            self.engine.check_prompt(job.prompt_ids)
            if job.stream and (body.get("return_token_ids") or body.get("return_meta_info")):
                raise chat.ChatRequestError(
                    "return_token_ids/return_meta_info are non-streaming only; use return_*_ids_in_sglext"
                )
        except BAD_INPUT as exc:
            return error_response(str(exc))
        rid = body.get("rid")
        request_id = rid if isinstance(rid, str) and rid else chat.new_request_id()
        if job.stream:
            return StreamingResponse(self._chat_stream(job, request_id), media_type="text/event-stream")
        top = job.top_logprobs if job.logprobs else 0
        try:
            gen = await self._run_generation(
                request,
                self._tracked(
                    request_id,
                    lambda cancelled, on_token: self.engine.generate(
                        job.prompt_ids,
                        job.params,
                        top_logprobs_num=top,
                        on_token=on_token,
                        cancelled=cancelled,
                        request_id=request_id,
                        tool_names=job.tool_names,
                    ),
                ),
            )
        except BAD_INPUT as exc:
            return error_response(str(exc))
        return JSONResponse(chat.chat_response(self.engine, job, gen))

    async def _chat_stream(self, job: chat.ChatJob, request_id: str) -> AsyncIterator[bytes]:
        engine, model, created = self.engine, self.engine.served_model_name, int(time.time())
        top = job.top_logprobs if job.logprobs else 0
        queue, cancelled = self._stream_steps(
            self._tracked(
                request_id,
                lambda c, on_token: engine.generate(
                    job.prompt_ids,
                    job.params,
                    top_logprobs_num=top,
                    on_token=on_token,
                    cancelled=c,
                    request_id=request_id,
                    tool_names=job.tool_names,
                ),
            )
        )
        decoder = IncrementalText(engine.tokenizer, job.params)
        parse = TextStreamParser(  # deltas that add up to the non-streamed answer's content and reasoning
            tool_call_parser=engine.tool_call_parser,
            reasoning_parser=job.reasoning_parser(engine),
            tools_given=job.tools_given,
            offered=job.tool_schemas,
        ).feed

        calls = []
        try:
            yield sse_event(chat.chunk(request_id, model, created, {"role": "assistant", "content": ""}))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    yield sse_event(
                        {"object": "error", "message": str(item), "type": "InternalServerError", "code": 500}
                    )
                    break
                if isinstance(item, Generation):
                    # An aborted generation's undecided tail (a tag begun, whitespace) is held back, not shown as
                    # text: a resumed call (the gateway's) goes on from it.
                    ended = (item.finish_reason or {}).get("type") != "abort"
                    pieces = parse(decoder.finish(item), final=ended)
                    for event in self._closing_events(job, item, pieces, calls, request_id, model, created):
                        yield event
                    break
                step: TokenStep = item
                logprobs = None
                if job.logprobs:
                    logprobs = {
                        "content": [
                            chat.token_logprob_entry(engine, step.token_id, step.logprob, step.top_logprobs)
                        ]
                    }
                pieces = parse(decoder.push(step.token_id))
                deltas = list(self._deltas(pieces, calls))
                if not deltas:
                    deltas = [{"content": ""}] if logprobs else []
                for i, payload in enumerate(deltas):
                    event = chat.chunk(
                        request_id, model, created, payload, logprobs=logprobs if i == 0 else None
                    )
                    if self.stream_weight_version and i == 0:
                        event["weight_version"] = (
                            step.weight_version
                        )  # this chunk's tokens' (a push may land)
                    yield sse_event(event)
            yield SSE_DONE
        finally:
            cancelled.set()  # client gone or stream over: stop decoding

    def _closing_events(
        self,
        job: chat.ChatJob,
        gen: Generation,
        pieces: list[tuple[str, object]],
        calls: list,
        request_id: str,
        model: str,
        created: int,
    ) -> Iterator[bytes]:
        """The end of a stream: the last deltas, the finish chunk, usage, and SGLang's sglext ids."""
        for payload in self._deltas(pieces, calls):
            yield sse_event(chat.chunk(request_id, model, created, payload))
        yield sse_event(
            chat.chunk(
                request_id,
                model,
                created,
                {},
                finish_reason=chat.openai_finish_reason(gen, calls),
                matched=chat.matched_stop(gen),
            )
        )
        if job.include_usage:
            yield sse_event(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": chat.usage(gen),
                }
            )
        want_in, want_out = job.want_sglext_ids
        if want_in or want_out:
            ext: dict[str, Any] = {}
            if want_in:
                ext["input_ids"] = [gen.prompt_ids]
            if want_out:
                ext["output_ids"] = [gen.output_ids]
            if self.stream_weight_version:
                ext["weight_version"] = gen.weight_version
                ext["version_spans"] = gen.spans()  # where a push landed between two tokens
            yield sse_event(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "sglext": ext,
                }
            )

    @staticmethod
    def _deltas(pieces, calls):
        for kind, value in pieces:
            if kind == "content" and value:
                yield {"content": value}
            elif kind == "reasoning" and value:
                yield {"reasoning_content": value}
            elif kind == "tool_call":
                calls.append(value)
                yield {"tool_calls": [value.to_openai(len(calls) - 1)]}

    async def generate(self, request: Request) -> Response:
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise chat.ChatRequestError("request body must be a JSON object")
            params = SamplingParams.from_sglang(body.get("sampling_params"))
            if body.get("input_ids") is not None:
                prompt_ids = body["input_ids"]
                if not isinstance(prompt_ids, list) or not all(isinstance(t, int) for t in prompt_ids):
                    raise chat.ChatRequestError("input_ids must be a flat list of integers (no batches)")
            elif isinstance(body.get("text"), str):
                prompt_ids = self.engine.tokenizer.encode(body["text"], add_special_tokens=False)
            else:
                raise chat.ChatRequestError("give `input_ids` or `text`")
            self.engine.check_prompt(prompt_ids)
            top = int(body.get("top_logprobs_num") or 0)
        except (*BAD_INPUT, TypeError, ValueError) as exc:
            return error_response(str(exc))
        want_logprob = bool(body.get("return_logprob"))

        def result(gen: Generation, text: str, ids: list[int], final: bool) -> dict:
            meta = gen.meta_info()
            if not want_logprob:
                meta.pop("output_token_logprobs")
            elif top:
                meta["output_top_logprobs"] = [
                    [[lp, tid, None] for lp, tid in row] for row in gen.output_top_logprobs
                ]
            if not final:
                meta["finish_reason"] = None
            return {"text": text, "output_ids": ids, "meta_info": meta}

        if body.get("stream"):
            return StreamingResponse(
                self._generate_stream(prompt_ids, params, top, result), media_type="text/event-stream"
            )
        gen = await self._run_generation(
            request,
            self._tracked(
                chat.new_request_id(),
                lambda cancelled, on_token: self.engine.generate(
                    prompt_ids, params, top_logprobs_num=top, on_token=on_token, cancelled=cancelled
                ),
            ),
        )
        return JSONResponse(result(gen, gen.text, gen.output_ids, True))

    async def _generate_stream(self, prompt_ids, params, top, result) -> AsyncIterator[bytes]:
        # SGLang's default: each chunk is cumulative (full text and ids so far).
        queue, cancelled = self._stream_steps(
            self._tracked(
                chat.new_request_id(),
                lambda c, on_token: self.engine.generate(
                    prompt_ids, params, top_logprobs_num=top, on_token=on_token, cancelled=c
                ),
            )
        )
        partial = Generation(request_id="", prompt_ids=prompt_ids, weight_version=self.engine.weight_version)
        decoder = IncrementalDecoder(self.engine.tokenizer, params.skip_special_tokens)
        text = ""
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    yield sse_event({"error": {"message": str(item)}})
                    break
                if isinstance(item, Generation):
                    yield sse_event(result(item, item.text, item.output_ids, True))
                    break
                partial.output_ids.append(item.token_id)
                partial.output_logprobs.append(item.logprob)
                partial.output_top_logprobs.append(item.top_logprobs)
                if not partial.version_spans or partial.version_spans[-1][1] != item.weight_version:
                    partial.version_spans.append((len(partial.output_ids) - 1, str(item.weight_version)))
                text += decoder.push(item.token_id)
                yield sse_event(result(partial, text, list(partial.output_ids), False))
            yield SSE_DONE
        finally:
            cancelled.set()

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/engine_stats", self.engine_stats, methods=["GET"]),
            Route("/abort_request", self.abort_request, methods=["POST"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/update_weights_from_disk", self.update_weights_from_disk, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/generate", self.generate, methods=["POST"]),
        ]


def build_app(
    engine: Engine,
    pacing: Pacing | None = None,
    *,
    api_key: str | None = None,
    stream_weight_version: bool = True,
    on_push: str = "swap",
) -> Starlette:
    """The engine's app; every route but /health needs `api_key` (without one: sampling routes only)."""
    server = EngineServer(engine, pacing, stream_weight_version=stream_weight_version, on_push=on_push)
    return Starlette(routes=server.routes(), middleware=[Middleware(KeyGuard, key=api_key)])
