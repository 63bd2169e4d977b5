"""An engine's streamed chat answer, assembled: deltas for the live encoders as chunks arrive, and at the end the
same `Completion` the non-streamed path builds — or an error when the stream's ids and logprobs do not add up.

The engine streams SGLang's shape: `chat.completion.chunk`s whose deltas carry `content`, `reasoning_content` and
`tool_calls` (whole, or — SGLang's incremental parsers — a name first, then argument pieces, keyed by `index`),
each with the logprobs of the tokens it covers; a finish chunk (`finish_reason`, `matched_stop`); the sglext
chunk (`choices: []`, `sglext: {input_ids, output_ids}`, plus `meta` from the vLLM dialect: what its answers'
meta info says about the engine); the usage chunk; `[DONE]`. A tool call is handed on
once it has closed (another call, text, or the finish follows), never half-written.

A call the engine aborted and the gateway resumed (engines/resume.py) streams in parts: `begin_part` makes what
was sampled so far the call's first tokens, the next stream adds the rest, and the Completion is one answer — the
ids and logprobs joined, one version span (at least) per part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polar_mitm.codecs.base import GatewayError
from polar_mitm.codecs.live.base import Delta
from polar_mitm.conversation import Completion, ToolCall


@dataclass
class _OpenCall:
    id: str
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class StreamAssembler:
    """Feeds on an engine's parsed stream chunks; yields deltas; assembles the Completion at the end."""

    def __init__(self) -> None:
        self.id = ""
        self.model = ""
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []
        self.logprobs: list[Any] = []  # the OpenAI `logprobs.content` entries, in order
        self.finish_reason: str | None = None
        self.matched_stop: Any = None
        self.input_ids: list[int] | None = None
        self.output_ids: list[int] | None = None
        self.weight_version: str | None = None
        # Where each span of tokens under one weight version starts (a push may land mid-stream): the sglext
        # chunk's `version_spans` when it has them, else gathered from each token chunk's `weight_version`.
        self.version_spans: list[dict[str, Any]] | None = None
        self._chunk_spans: list[dict[str, Any]] = []
        # A resumed call's earlier parts: their sampled ids, version spans (absolute), the first part's prompt and
        # version; `part_version` is the version read before this part's request (engines whose streams say none).
        self.parts = 0
        self.part_version: str | None = None
        self._prior_ids: list[int] = []
        self._prior_spans: list[dict[str, Any]] = []
        self._prompt_ids: list[int] | None = None
        self._first_version: str | None = None
        self._logprob_base = (
            0  # logprobs of the earlier parts (chunk spans start from this part's first token)
        )
        self.usage: dict[str, Any] = {}
        # SGLang's logprobs are after temperature; an engine that says otherwise does so in sglext's `meta`.
        self.engine_meta: dict[str, Any] = {"logprobs_temperature_scaled": True}
        self.chunks = 0
        self._open: dict[int, _OpenCall] = {}  # tool calls still being written, by index

    def feed(self, chunk: Any) -> list[Delta]:
        """The deltas one engine chunk brings (raises GatewayError on an in-stream engine error)."""
        if not isinstance(chunk, dict):
            raise GatewayError(
                "engine_error", f"the engine streamed a chunk that is not an object: {chunk!r:.200}"
            )
        if chunk.get("error") is not None or chunk.get("object") == "error":
            error = chunk.get("error") if isinstance(chunk.get("error"), dict) else chunk
            raise GatewayError(
                "engine_error", f"the engine failed mid-stream: {error.get('message', error)!r:.500}"
            )
        self.chunks += 1
        self.id = self.id or str(chunk.get("id") or "")
        self.model = self.model or str(chunk.get("model") or "")
        self._take_extras(chunk)
        deltas: list[Delta] = []
        for choice in chunk.get("choices") or ():
            deltas += self._choice(choice)
        return deltas

    def finish(self) -> list[Delta]:
        """The stream ended: close the calls still open."""
        return self._close_calls()

    def begin_part(self, next_version: str | None) -> None:
        """The engine aborted the call and the gateway resumes it: the tokens streamed so far become the call's
        first ones, the next stream (prompt + those tokens in) continues them; `next_version` is the version read
        before its request (None where the stream says its own)."""
        offset = len(self._prior_ids)
        self._prior_spans = _merged(self._prior_spans + _shifted(self._part_spans(), offset))
        self._prior_ids += self.output_ids or []
        if self.parts == 0:
            self._prompt_ids, self._first_version = self.input_ids, self.weight_version
        self.parts += 1
        self.part_version = next_version
        self._logprob_base = len(self.logprobs)
        self.input_ids = self.output_ids = self.version_spans = None
        self._chunk_spans = []
        self.finish_reason = self.matched_stop = None

    @property
    def sampled_ids(self) -> list[int]:
        """Every token sampled for the call so far (the current part's once its sglext chunk came)."""
        return self._prior_ids + list(self.output_ids or ())

    @property
    def prompt_ids(self) -> list[int] | None:
        """The call's prompt (the first part's)."""
        return self._prompt_ids if self.parts else self.input_ids

    def _part_spans(self) -> list[dict[str, Any]]:
        """This part's version spans, relative to its first token: the engine's, else its version read before."""
        spans = self.version_spans or self._chunk_spans
        if spans:
            return [dict(span) for span in spans]
        version = self.weight_version if self.weight_version is not None else self.part_version
        return [] if version is None else [{"start": 0, "version": str(version)}]

    def _spans(self) -> list[dict[str, Any]]:
        """The call's version spans: this stream's own, or — for a resumed call — every part's, joined."""
        if not self.parts:
            return self.version_spans or self._chunk_spans
        tail = self._part_spans()
        if not tail or not self._prior_spans:
            return []  # a part of unknown version: the record keeps one version (its weight_version)
        sampled = len(self.sampled_ids)
        spans = _merged(self._prior_spans + _shifted(tail, len(self._prior_ids)))
        return [span for span in spans if span["start"] < max(sampled, 1)]

    def _take_extras(self, chunk: dict[str, Any]) -> None:
        ext = chunk.get("sglext")
        if isinstance(ext, dict):
            if ext.get("input_ids") is not None:
                self.input_ids = _flat(ext["input_ids"])
            if ext.get("output_ids") is not None:
                self.output_ids = _flat(ext["output_ids"])
            if ext.get("weight_version") is not None:
                self.weight_version = str(ext["weight_version"])
            if isinstance(ext.get("version_spans"), list):
                self.version_spans = ext["version_spans"]
            if isinstance(ext.get("meta"), dict):
                self.engine_meta.update(ext["meta"])
        version = chunk.get("weight_version")  # this chunk's tokens' version (ours; `choices` not yet taken)
        if version is not None and (
            not self._chunk_spans or self._chunk_spans[-1]["version"] != str(version)
        ):
            self._chunk_spans.append(
                {"start": len(self.logprobs) - self._logprob_base, "version": str(version)}
            )
        metadata = chunk.get("metadata")
        if isinstance(metadata, dict) and metadata.get("weight_version") is not None:
            self.weight_version = str(metadata["weight_version"])
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]

    def _choice(self, choice: dict[str, Any]) -> list[Delta]:
        deltas: list[Delta] = []
        delta = choice.get("delta") or {}
        if delta.get("tool_calls"):
            for piece in delta["tool_calls"]:
                deltas += self._call_piece(piece)
        for key, kind, store in (
            ("reasoning_content", "reasoning", self.reasoning),
            ("content", "text", self.content),
        ):
            text = delta.get(key)
            if isinstance(text, str) and text:
                deltas += self._close_calls()
                store.append(text)
                deltas.append(Delta(kind, text))  # type: ignore[arg-type]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("content"):
            self.logprobs += logprobs["content"]
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            self.matched_stop = choice.get("matched_stop")
            deltas += self._close_calls()
        return deltas

    def _call_piece(self, piece: dict[str, Any]) -> list[Delta]:
        index = piece.get("index", len(self.calls) + len(self._open))
        function = piece.get("function") or {}
        out: list[Delta] = []
        if index not in self._open:
            out = self._close_calls()  # a new call closes the one before it
            self._open[index] = _OpenCall(id=str(piece.get("id") or f"call_{index}"))
        call = self._open[index]
        call.name += function.get("name") or ""
        if function.get("arguments"):
            call.arguments.append(function["arguments"])
        return out

    def _close_calls(self) -> list[Delta]:
        closed = [
            ToolCall(id=c.id, name=c.name, arguments="".join(c.arguments) or "{}")
            for _, c in sorted(self._open.items())
        ]
        self._open.clear()
        self.calls += closed
        return [Delta("tool_call", call=call) for call in closed]

    # -- the end -----------------------------------------------------------------------------------------------

    def engine_response(self) -> dict[str, Any]:
        """The stream as the non-streamed engine answer would have said it (`Completion.from_engine_response`)."""
        finish = self.finish_reason or "stop"
        prompt_ids = self.prompt_ids
        output_ids = self.sampled_ids if self.output_ids is not None else None
        meta = {
            **self.engine_meta,
            "id": self.id,
            "prompt_tokens": len(prompt_ids or ()),
            "completion_tokens": len(output_ids or ()),
            "finish_reason": {
                "type": "stop" if finish == "tool_calls" else finish,
                "matched": self.matched_stop,
            },
            "weight_version": self._first_version if self.parts else self.weight_version,
            "streamed": True,
        }
        if self.parts:
            meta["resumed"] = (
                self.parts
            )  # the engine aborted the call this many times; the gateway resumed it
        spans = self._spans()
        if spans:
            meta["version_spans"] = spans
        cached = (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if isinstance(cached, int):
            meta["cached_tokens"] = cached
        message = {
            "role": "assistant",
            "content": "".join(self.content),
            "reasoning_content": "".join(self.reasoning) or None,
            "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls
            ],
        }
        return {
            "id": self.id,
            "model": self.model,
            "choices": [
                {
                    "message": message,
                    "finish_reason": finish,
                    "prompt_token_ids": prompt_ids,
                    "response_token_ids": output_ids,
                    "logprobs": {"content": self.logprobs},
                    "meta_info": meta,
                }
            ],
        }

    def completion(self) -> Completion:
        """The finished Completion, validated as the non-streamed answer is; ValueError when the ids or logprobs
        are missing or do not add up (the call is then recorded as an error, never as training data)."""
        if self.finish_reason is None:
            raise ValueError("the engine's stream ended without a finish reason")
        if self.input_ids is None or self.output_ids is None:
            raise ValueError(
                "the engine's stream has no sglext ids (return_input_ids_in_sglext / "
                "return_output_ids_in_sglext ignored?)"
            )
        completion = Completion.from_engine_response(self.engine_response())
        return completion

    def display(self) -> Completion:
        """What the harness is shown when the ids did not add up: the text, calls and finish, no ids."""
        finish = (
            self.finish_reason if self.finish_reason in ("stop", "length", "tool_calls", "abort") else "stop"
        )
        if self.calls and finish == "stop":
            finish = "tool_calls"
        return Completion(
            id=self.id,
            model=self.model,
            content="".join(self.content),
            reasoning="".join(self.reasoning) or None,
            tool_calls=list(self.calls),
            finish_reason=finish,  # type: ignore[arg-type]
            prompt_ids=list(self.prompt_ids or ()),
            completion_ids=self.sampled_ids,
            completion_logprobs=[],
            weight_version=self._first_version if self.parts else self.weight_version,
        )


def _flat(ids: Any) -> list[int]:
    """sglext ids: `[[...]]` (one list per choice) or a flat list (SGLang's shared prompt); we ask for one choice."""
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return ids[0]
    return ids


def _shifted(spans: list[dict[str, Any]], offset: int) -> list[dict[str, Any]]:
    return [{"start": span["start"] + offset, "version": span["version"]} for span in spans]


def _merged(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Spans in order with neighbours of one version joined (a part resumed under the weights that began it)."""
    out: list[dict[str, Any]] = []
    for span in spans:
        while out and span["start"] <= out[-1]["start"]:
            out.pop()  # an empty span (a part that sampled nothing) gives way to the next
        if not (out and str(out[-1]["version"]) == str(span["version"])):
            out.append(span)
    return out
