"""The internal conversation every provider codec decodes into, and the engine answer every codec encodes from.

One shape for all four provider APIs: codecs translate at the edges, the gateway and the records only see this.
Never import mitmproxy here (codecs, reconstruct and train must not depend on it).
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import orjson

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, exactly as the model (or the harness) wrote it

    def arguments_obj(self) -> Any:
        """Arguments parsed; `{}` for empty text; the raw text under "_raw" if it is not JSON."""
        if not self.arguments.strip():
            return {}
        try:
            return json.loads(self.arguments)
        except ValueError:
            return {"_raw": self.arguments}


@dataclass
class Message:
    role: Role
    content: str = ""
    reasoning: str | None = None  # thinking text of an assistant turn, when the harness sent it back
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # for role == "tool"
    name: str | None = None  # tool name of a tool result (Google matches results by name)

    def to_engine(self) -> dict[str, Any]:
        """OpenAI chat message, as SGLang's chat template expects it."""
        msg: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            msg["tool_call_id"] = self.tool_call_id
        if self.role == "tool" and self.name:
            msg["name"] = self.name
        return msg


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_engine(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class Conversation:
    """A provider request, decoded: what to ask the engine, plus what the encoder needs to answer in kind."""

    messages: list[Message]
    model: str = ""
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "none" | "required" | {"name": ...}
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    thinking: bool | None = None  # harness asked for reasoning (None = provider default)
    include_usage: bool = False  # OpenAI chat stream_options.include_usage
    # Structured output, as SGLang's chat `response_format` (codecs/structured.py); None = free text.
    response_format: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # provider-specific echoes (metadata, store, ...)
    # The harness asks for a summary of its history to go on from (a remote compaction request): call_kind
    # "compaction", whatever the path; the codec answers in its compaction shape.
    compaction: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # what the engine was sent (set by the gateway)

    def messages_json(self) -> list[dict[str, Any]]:
        return [asdict(m) for m in self.messages]

    def tools_json(self) -> list[dict[str, Any]]:
        return [asdict(t) for t in self.tools]

    def to_engine_request(self, *, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The SGLang `/v1/chat/completions` body: non-streaming, with ids, logprobs and meta info."""
        body: dict[str, Any] = {
            "model": "default",
            "messages": [m.to_engine() for m in self.messages],
            "stream": False,
            "logprobs": True,
            "return_token_ids": True,
            "return_meta_info": True,
        }
        if self.tools and self.tool_choice != "none":
            body["tools"] = [t.to_engine() for t in self.tools]
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        for key in ("temperature", "top_p", "top_k"):
            value = getattr(self, key)
            if value is not None:
                body[key] = value
        if self.stop:
            body["stop"] = list(self.stop)
        if self.thinking is False:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        if self.response_format is not None:
            body["response_format"] = self.response_format
        for key, value in (overrides or {}).items():
            if value is not None:
                body[key] = value
        return body


@dataclass
class Completion:
    """The engine's answer, with everything training needs."""

    id: str
    model: str
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    weight_version: str | None = None
    meta_info: dict[str, Any] = field(default_factory=dict)
    meta_json: str | None = None  # meta_info as JSON text, set by the gateway once it is known to encode

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.completion_ids)

    @classmethod
    def from_engine_answer(
        cls, raw: bytes, sent_ids: list[int] | None = None, sent_ids_json: bytes | None = None
    ) -> Completion:
        """Parse an engine's raw chat answer. With the `input_ids` sent (`sent_ids`, and as `orjson.dumps` wrote
        them in the request, `sent_ids_json`): an echo of exactly those bytes is known to be those ids, so it is
        cut out before parsing and the sent list stands for it — a byte comparison instead of parsing and checking
        one Python int per prompt token (~0.3 ms at 8k tokens). Any other echo is parsed and checked in full."""
        if sent_ids is not None and sent_ids_json is not None:
            cut = without_echo(raw, sent_ids_json)
            if cut is not None:
                return cls.from_engine_response(orjson.loads(cut), echoed_prompt_ids=sent_ids)
        return cls.from_engine_response(orjson.loads(raw))

    @classmethod
    def from_engine_response(
        cls, resp: dict[str, Any], *, echoed_prompt_ids: list[int] | None = None
    ) -> Completion:
        """Parse SGLang's chat answer (with `return_token_ids`, `return_meta_info`, `logprobs`).

        Raises ValueError/TypeError/KeyError on an answer that is malformed in any way a record could carry:
        an acknowledged record must always convert to the Parquet schema (int32 ids, float32 logprobs, strings).
        `echoed_prompt_ids`: the prompt ids the answer was proved to echo (`from_engine_answer`), already checked.
        """
        choice = resp["choices"][0]
        message = choice.get("message") or {}
        prompt_ids = choice.get("prompt_token_ids")
        if prompt_ids is None and echoed_prompt_ids is not None:
            prompt_ids = echoed_prompt_ids  # proved to be the echo of the ids sent
        elif prompt_ids is not None:
            check_token_ids(prompt_ids, "prompt_token_ids")
        completion_ids = choice.get("response_token_ids")
        if prompt_ids is None or completion_ids is None:
            # Never treat a missing id list as empty: that silently corrupts training data.
            raise ValueError(
                "engine answer lacks prompt_token_ids/response_token_ids (return_token_ids ignored?)"
            )
        check_token_ids(completion_ids, "response_token_ids")
        if not prompt_ids:
            raise ValueError("engine answer has an empty prompt_token_ids")
        meta = dict(choice.get("meta_info") or {})
        triples = meta.pop("output_token_logprobs", None)
        if triples is not None:
            logprobs = checked_logprobs([t[0] for t in triples])
        else:
            logprobs = checked_logprobs(
                [e["logprob"] for e in ((choice.get("logprobs") or {}).get("content") or [])]
            )
        if len(logprobs) != len(completion_ids):
            raise ValueError(f"engine gave {len(logprobs)} logprobs for {len(completion_ids)} sampled tokens")
        calls = [
            ToolCall(
                id=optional_text(c.get("id"), "tool call id") or f"call_{i}",
                name=required_text(c["function"]["name"], "tool call name"),
                arguments=optional_text(c["function"].get("arguments"), "tool call arguments") or "{}",
            )
            for i, c in enumerate(message.get("tool_calls") or [])
        ]
        finish = choice.get("finish_reason") or "stop"
        if calls and finish == "stop":
            finish = "tool_calls"
        version = meta.get("weight_version") or (resp.get("metadata") or {}).get("weight_version")
        return cls(
            id=optional_text(resp.get("id"), "id") or "",
            model=optional_text(resp.get("model"), "model") or "",
            content=optional_text(message.get("content"), "content") or "",
            reasoning=optional_text(message.get("reasoning_content"), "reasoning_content"),
            tool_calls=calls,
            finish_reason=finish if finish in ("stop", "length", "tool_calls", "abort") else "stop",
            # orjson already yields ints; re-wrapping 30k-id prompts would cost ~1 ms per call on the hot path.
            prompt_ids=list(prompt_ids),
            completion_ids=list(completion_ids),
            completion_logprobs=logprobs,
            weight_version=None if version is None else str(version),
            meta_info=meta,
        )


def harness_safe(completion: Completion, offered: Sequence[str]) -> Completion:
    """The answer a harness can always act on, whatever the model sampled (ids and logprobs untouched).

    A small model emits tool calls the harness cannot run: a tool the request does not offer, or arguments that
    are not a JSON object (SGLang may pass such calls on). Those become visible text — the call as the model
    wrote it — rather than a call the harness would crash on. An answer that is all reasoning (an unclosed
    `<think>`, or nothing after it) shows its reasoning as the text, since several harnesses treat an answer
    with no text and no call as an error. The finish reason follows what is left: `tool_calls` only while a
    call remains; a truncated answer stays `length`.
    """
    names = set(offered)
    kept = [c for c in completion.tool_calls if c.name in names and _object_arguments(c)]
    rejected = [c for c in completion.tool_calls if c not in kept]
    if rejected:
        shown = "\n".join(_as_text(c) for c in rejected)
        completion.content = f"{completion.content}\n{shown}" if completion.content else shown
        completion.tool_calls = kept
        if not kept and completion.finish_reason == "tool_calls":
            completion.finish_reason = "stop"
    if not completion.content and not completion.tool_calls and completion.reasoning:
        completion.content, completion.reasoning = completion.reasoning, None
    return completion


def _object_arguments(call: ToolCall) -> bool:
    try:
        return isinstance(json.loads(call.arguments or "{}"), dict)
    except ValueError:
        return False


def _as_text(call: ToolCall) -> str:
    """A rejected call in the model's own `<tool_call>` notation."""
    return f'<tool_call>\n{{"name": {json.dumps(call.name)}, "arguments": {call.arguments or "{}"}}}\n</tool_call>'


ECHO_KEY = b'"prompt_token_ids":'


def without_echo(raw: bytes, sent_ids_json: bytes) -> bytes | None:
    """`raw` with its one `"prompt_token_ids":` value replaced by null when that value is byte for byte
    `sent_ids_json` (a JSON list, closing bracket included, so not a longer or shorter list); else None. The key's
    bytes cannot occur inside a JSON string (its quotes would be escaped), and a second occurrence is refused."""
    at = raw.find(ECHO_KEY)
    if at < 0 or raw.find(ECHO_KEY, at + len(ECHO_KEY)) >= 0:
        return None
    start = at + len(ECHO_KEY)
    if not raw.startswith(sent_ids_json, start):
        return None
    return raw[:start] + b"null" + raw[start + len(sent_ids_json) :]


TOKEN_ID_LIMIT = 2**31  # records store ids as int32
# A logprob is ≤ 0; allow float rounding above it, nothing more (a positive logprob is a broken engine).
LOGPROB_TOLERANCE = 1e-5


def check_token_ids(ids: Any, where: str) -> None:
    """A list of ints in [0, 2^31): bools, floats, strings or out-of-range ids are a broken engine answer."""
    if type(ids) is not list:
        raise ValueError(f"engine answer's {where} is not a list")
    if not ids:
        return
    # One C pass (a Python loop costs ~1 ms per 30k ids; three passes of min/max/type ~0.4 ms per 8k): array()
    # refuses floats, strings and None, and numpy checks the range.
    try:
        values = np.frombuffer(array("q", ids), dtype=np.int64)
    except (TypeError, OverflowError):
        values = None
    if values is None or values.min() < 0 or values.max() >= TOKEN_ID_LIMIT:
        raise ValueError(f"engine answer's {where} holds a value that is not a token id in [0, 2^31)")
    # array() takes True and False as 1 and 0: only those positions can hold a bool.
    if any(type(ids[i]) is bool for i in np.flatnonzero(values <= 1).tolist()):
        raise ValueError(f"engine answer's {where} holds a value that is not a token id in [0, 2^31)")


def checked_logprobs(values: list[Any]) -> list[float]:
    """The sampled tokens' logprobs as floats: finite numbers ≤ 0 (within rounding), else ValueError."""
    if not set(map(type, values)) <= {float, int}:
        raise ValueError("engine answer has a logprob that is not a number")
    logprobs = list(map(float, values))
    if logprobs and not (all(map(math.isfinite, logprobs)) and max(logprobs) <= LOGPROB_TOLERANCE):
        raise ValueError("engine answer has a logprob that is not finite or is positive")
    return logprobs


def optional_text(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"engine answer's {where} is not a string")
    return value


def required_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"engine answer's {where} is not a string")
    return value
