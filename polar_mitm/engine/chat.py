"""`/v1/chat/completions` with SGLang's extensions: request → prompt ids + sampling params; generation → answer.

The field names and shapes follow SGLang 0.5 (`return_token_ids` → `prompt_token_ids`/`response_token_ids`,
`return_meta_info` → `meta_info`, `input_ids` skips the chat template, the streamed "sglext" chunk carries ids).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from polar_mitm.engine.constraints import ConstraintError, spec_from_response_format
from polar_mitm.engine.generation import Engine, Generation
from polar_mitm.engine.parsers import ParsedCall, parse_output
from polar_mitm.engine.sampling import SamplingError, SamplingParams
from polar_mitm.engine.tool_call_formats import tool_parameters

DEFAULT_MAX_TOKENS = 1024


class ChatRequestError(ValueError):
    """A chat request the engine cannot serve (→ HTTP 400)."""


@dataclass
class ChatJob:
    """A validated chat request, ready to generate."""

    body: dict[str, Any]
    prompt_ids: list[int]
    params: SamplingParams
    logprobs: bool
    top_logprobs: int
    tools_given: bool
    stream: bool
    tool_names: list[str] = field(default_factory=list)  # for a scripted policy (see engine/script.py)
    tool_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # name → parameters, for the parser

    def reasoning_parser(self, engine: Engine) -> str:
        """The engine's reasoning parser, or none when the request asks for the reasoning inline (SGLang's
        `separate_reasoning: false`: the gateway's resumed calls parse the raw text themselves)."""
        return "none" if self.body.get("separate_reasoning") is False else engine.reasoning_parser

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    @property
    def want_sglext_ids(self) -> tuple[bool, bool]:
        return bool(self.body.get("return_input_ids_in_sglext")), bool(
            self.body.get("return_output_ids_in_sglext")
        )


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise ChatRequestError(f"{where}: content parts must be objects")
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            else:
                raise ChatRequestError(f"{where}: content part type {kind!r} is not supported (text only)")
        return "".join(parts)
    raise ChatRequestError(f"{where}: content must be a string or a list of parts")


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages → what HF chat templates expect (plain-text content, tool_calls kept)."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise ChatRequestError(f"messages[{i}]: needs a role of system|developer|user|assistant|tool")
        role = "system" if msg["role"] == "developer" else msg["role"]
        item: dict[str, Any] = {"role": role, "content": _text_of(msg.get("content"), f"messages[{i}]")}
        if msg.get("reasoning_content"):
            item["reasoning_content"] = msg["reasoning_content"]
        if msg.get("tool_calls"):
            item["tool_calls"] = msg["tool_calls"]
        if msg.get("tool_call_id"):
            item["tool_call_id"] = msg["tool_call_id"]
        if msg.get("name"):
            item["name"] = msg["name"]
        out.append(item)
    return out


def build_job(engine: Engine, body: dict[str, Any]) -> ChatJob:
    """Validate a chat request and render its prompt ids (or take `input_ids` as they are)."""
    if not isinstance(body, dict):
        raise ChatRequestError("request body must be a JSON object")
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise ChatRequestError("tools must be a list")
    if body.get("input_ids") is not None:
        prompt_ids = body["input_ids"]
        if not isinstance(prompt_ids, list) or not all(isinstance(t, int) for t in prompt_ids):
            raise ChatRequestError("input_ids must be a list of integers")
    else:
        messages = normalise_messages(body.get("messages"))
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ChatRequestError("chat_template_kwargs must be an object")
        try:
            prompt_ids = engine.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
            )
        except Exception as exc:  # template errors are the caller's input problem
            raise ChatRequestError(f"chat template failed: {exc}") from exc
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    raw = {
        "max_new_tokens": max_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "min_p": body.get("min_p"),
        "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"),
        "ignore_eos": body.get("ignore_eos"),
        "skip_special_tokens": body.get("skip_special_tokens"),
        "no_stop_trim": body.get("no_stop_trim"),
        "sampling_seed": body.get("seed", body.get("sampling_seed")),
        "frequency_penalty": body.get("frequency_penalty") or None,
        "presence_penalty": body.get("presence_penalty") or None,
        "repetition_penalty": body.get("repetition_penalty"),
        "n": body.get("n"),
        **constraint_params(body),
    }
    try:
        params = SamplingParams.from_sglang({k: v for k, v in raw.items() if v is not None})
        engine.check_constraint(params)  # a schema that does not compile is a 400 before anything runs
    except (SamplingError, TypeError) as exc:
        raise ChatRequestError(str(exc)) from exc
    top = body.get("top_logprobs") or 0
    if not isinstance(top, int) or not 0 <= top <= 20:
        raise ChatRequestError("top_logprobs must be an integer in [0, 20]")
    return ChatJob(
        body=body,
        prompt_ids=list(prompt_ids),
        params=params,
        logprobs=bool(body.get("logprobs")),
        top_logprobs=top,
        tools_given=bool(tools) and body.get("tool_choice") != "none",  # SGLang parses no calls under "none"
        stream=bool(body.get("stream")),
        tool_names=tool_names_of(tools),
        tool_schemas=tool_parameters(tools),
    )


def constraint_params(body: dict[str, Any]) -> dict[str, Any]:
    """SGLang's chat constraint fields → sampling params: `response_format` (json_schema | json_object) as
    `json_schema`, or SGLang's own `regex` / `ebnf` request fields."""
    try:
        spec = spec_from_response_format(body.get("response_format"))
    except ConstraintError as exc:
        raise ChatRequestError(str(exc)) from exc
    out: dict[str, Any] = {"regex": body.get("regex"), "ebnf": body.get("ebnf")}
    if spec is not None:
        out["json_schema"] = spec.source
    return out


def tool_names_of(tools: list[Any] | None) -> list[str]:
    """Function names of OpenAI-style tool definitions (malformed entries are the template's problem)."""
    names = []
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def token_logprob_entry(engine: Engine, token_id: int, logprob: float, top: list[tuple[float, int]]) -> dict:
    """An OpenAI `logprobs.content[j]` entry (text form; pair with `response_token_ids` for ids)."""
    text = engine.tokenizer.decode([token_id])
    return {
        "token": text,
        "bytes": list(text.encode("utf-8")),
        "logprob": logprob,
        "top_logprobs": [
            {"token": (t := engine.tokenizer.decode([tid])), "bytes": list(t.encode("utf-8")), "logprob": lp}
            for lp, tid in top
        ],
    }


def openai_finish_reason(gen: Generation, calls: list[ParsedCall]) -> str:
    kind = (gen.finish_reason or {}).get("type", "stop")
    if kind == "stop" and calls:
        return "tool_calls"
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(kind, "stop")


def matched_stop(gen: Generation):
    return (gen.finish_reason or {}).get("matched")


def chat_response(engine: Engine, job: ChatJob, gen: Generation) -> dict[str, Any]:
    """The non-streaming chat completion, with SGLang's token-id and meta-info extensions when asked."""
    parsed = parse_output(
        gen.text,
        tool_call_parser=engine.tool_call_parser,
        reasoning_parser=job.reasoning_parser(engine),
        tools_given=job.tools_given,
        offered=job.tool_schemas,
    )
    message: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content or None,
        "reasoning_content": parsed.reasoning,
        "tool_calls": [c.to_openai(i) for i, c in enumerate(parsed.tool_calls)] or None,
    }
    if message["content"] is None and not parsed.tool_calls:
        message["content"] = ""
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": openai_finish_reason(gen, parsed.tool_calls),
        "matched_stop": matched_stop(gen),
    }
    if job.logprobs:
        choice["logprobs"] = {
            "content": [
                token_logprob_entry(engine, tid, lp, top)
                for tid, lp, top in zip(
                    gen.output_ids, gen.output_logprobs, gen.output_top_logprobs, strict=True
                )
            ]
        }
    if job.body.get("return_token_ids"):
        choice["prompt_token_ids"] = gen.prompt_ids
        choice["response_token_ids"] = gen.output_ids
    if job.body.get("return_meta_info"):
        choice["meta_info"] = gen.meta_info()
    return {
        "id": gen.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": engine.served_model_name,
        "choices": [choice],
        "usage": usage(gen),
        "metadata": {"weight_version": gen.weight_version},
    }


def usage(gen: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": len(gen.prompt_ids),
        "completion_tokens": len(gen.output_ids),
        "total_tokens": len(gen.prompt_ids) + len(gen.output_ids),
    }


def chunk(
    request_id: str, model: str, created: int, delta: dict, *, finish_reason=None, logprobs=None, matched=None
) -> dict:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["matched_stop"] = matched
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def new_request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"
