"""Resuming a call the engine aborted (issue 43): SGLang's weight update aborts every running request by default, and
any engine may abort a call the harness never gave up on. The gateway then sends prompt + the tokens sampled so far
back through the token-in path with the rest of the budget (`continuation_request`), at most `MAX_RESUMES` times,
and the harness's stream goes on where it stopped: one answer, one record (engines/stream.py joins the parts). A
call answered whole is resumed the same way, its parts joined into one engine answer (`joined_answer`) before the
harness sees any of it.

The continuation is asked for as raw text (`separate_reasoning: false`, `tool_choice: "none"`: SGLang's fields, the
embedded engine and the vLLM dialect honour them) and parsed here (`ResumedText`), by a parser that has first read
the text the harness was already sent — so reasoning cut by the abort stays reasoning, and a tool call whose
opening tag came before the abort is still a call. The parsers are the embedded engine's (engine/parsers.py), named
by the engine's model info as on the vLLM path.
"""

from __future__ import annotations

from typing import Any

from polar_mitm.engine.parsers import ParsedCall, TextStreamParser, parse_output
from polar_mitm.engine.tool_call_formats import DEFAULT_TOOL_CALL_PARSER, tool_parameters

MAX_RESUMES = 3  # a call aborted more often than this ends as an engine error
BUDGET_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens")
FLOOR_FIELDS = ("min_tokens", "min_new_tokens")


def continuation_request(
    request: dict[str, Any], prompt_ids: list[int], sampled_ids: list[int], *, rid: str
) -> dict[str, Any] | None:
    """The engine request that continues `request` after `sampled_ids` (token-in: the chat template is skipped,
    the messages stay for the engine's bookkeeping); None when the budget is spent (nothing is left to sample)."""
    body = dict(request)
    body["input_ids"] = list(prompt_ids) + list(sampled_ids)
    for key in BUDGET_FIELDS:
        if isinstance(body.get(key), int):
            body[key] -= len(sampled_ids)
            if body[key] <= 0:
                return None
    for key in FLOOR_FIELDS:
        if isinstance(body.get(key), int):
            body[key] = max(body[key] - len(sampled_ids), 0)
    body.pop("chat_template_kwargs", None)  # only shapes a rendered prompt; these ids are the prompt
    body.update(separate_reasoning=False, tool_choice="none", rid=rid)
    return body


def seen_text(logprobs: list[Any], reasoning: str, content: str, calls: int) -> str:
    """The raw text of the tokens streamed so far: their logprob entries' token texts (SGLang and the embedded
    engine give them), else rebuilt from what the harness was sent (the parser's state, not the exact text)."""
    tokens = [entry.get("token") if isinstance(entry, dict) else None for entry in logprobs]
    if tokens and all(isinstance(token, str) for token in tokens):
        return "".join(tokens)  # type: ignore[arg-type]
    text = f"<think>\n{reasoning}" if reasoning else ""
    if reasoning and (content or calls):
        text += "\n</think>\n\n"
    return text + content


class ResumedText:
    """The continuation's raw text chunks → SGLang chunks with parsed deltas (reasoning, content, whole tool calls),
    parsed from where the first part's stream left off."""

    def __init__(self, request: dict[str, Any], model_info: dict[str, Any], seen: str, calls: int) -> None:
        tools = request.get("tools") or []
        self.parser = TextStreamParser(
            tool_call_parser=str(model_info.get("tool_call_parser") or DEFAULT_TOOL_CALL_PARSER),
            reasoning_parser=str(model_info.get("reasoning_parser") or "none"),
            tools_given=bool(tools) and request.get("tool_choice") != "none",
            offered=tool_parameters(tools),
        )
        self.parser.feed(seen)  # what the harness already has: only the parser's state is kept
        self.calls = calls  # tool calls the call made so far (the next one's index)

    def rewrite(self, chunk: Any) -> list[Any]:
        """One engine chunk as the chunks the assembler reads: one per parsed piece, the logprobs on the first,
        the finish last (`tool_calls` when the call made any)."""
        if not isinstance(chunk, dict) or not chunk.get("choices"):
            return [chunk]
        out: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            delta = dict(choice.get("delta") or {})
            finish = choice.get("finish_reason")
            pieces = self.parser.feed(str(delta.pop("content", None) or ""), final=bool(finish))
            deltas = [self._delta(kind, value) for kind, value in pieces]
            if delta.get("reasoning_content") or delta.get("tool_calls"):
                deltas.insert(0, delta)  # an engine that parsed anyway: passed on
            entries = [{"index": 0, "delta": d} for d in deltas if d] or [{"index": 0, "delta": {}}]
            if choice.get("logprobs"):
                entries[0]["logprobs"] = choice["logprobs"]
            if finish:
                closing = "tool_calls" if finish == "stop" and self.calls else finish
                entries.append(
                    {
                        "index": 0,
                        "delta": {},
                        "finish_reason": closing,
                        "matched_stop": choice.get("matched_stop"),
                    }
                )
            out += [{**chunk, "choices": [entry]} for entry in entries if entry["delta"] or len(entry) > 2]
        return out

    def _delta(self, kind: str, value: object) -> dict[str, Any]:
        if kind == "tool_call" and isinstance(value, ParsedCall):
            self.calls += 1
            return {"tool_calls": [value.to_openai(self.calls - 1)]}
        if not value:
            return {}
        return {"reasoning_content" if kind == "reasoning" else "content": value}


def answer_version(answer: dict[str, Any]) -> str | None:
    """The weight version a whole engine answer says sampled it (SGLang's meta_info, else its metadata)."""
    choice = answer["choices"][0]
    version = (choice.get("meta_info") or {}).get("weight_version") or (answer.get("metadata") or {}).get(
        "weight_version"
    )
    return None if version is None else str(version)


def joined_answer(
    first: dict[str, Any], rest: dict[str, Any], request: dict[str, Any], model_info: dict[str, Any]
) -> dict[str, Any]:
    """Two parts of a whole (non-streamed) answer as one engine answer: the first part (the engine's own, parsed)
    and its continuation (raw text, from `continuation_request`). The joined raw text is parsed again, so reasoning
    or a tool call cut by the abort comes out whole; ids, logprobs and version spans are the parts' in order, the
    weight version the first part's (what began the call), `meta_info.resumed` how many times it was resumed."""
    head, tail = first["choices"][0], rest["choices"][0]
    message = head.get("message") or {}
    head_entries = (head.get("logprobs") or {}).get("content") or []
    seen = seen_text(
        head_entries,
        message.get("reasoning_content") or "",
        message.get("content") or "",
        len(message.get("tool_calls") or []),
    )
    text = seen + str((tail.get("message") or {}).get("content") or "")
    tools = request.get("tools") or []
    parsed = parse_output(
        text,
        tool_call_parser=str(model_info.get("tool_call_parser") or DEFAULT_TOOL_CALL_PARSER),
        reasoning_parser=str(model_info.get("reasoning_parser") or "none"),
        tools_given=bool(tools) and request.get("tool_choice") != "none",
        offered=tool_parameters(tools),
    )
    calls = [call.to_openai(i) for i, call in enumerate(parsed.tool_calls)]
    finish = tail.get("finish_reason") or "stop"
    n_head = len(head["response_token_ids"])
    head_meta, tail_meta = dict(head.get("meta_info") or {}), dict(tail.get("meta_info") or {})
    head_version, tail_version = answer_version(first), answer_version(rest)
    spans = head_meta.get("version_spans") or (
        [{"start": 0, "version": head_version}] if head_version else None
    )
    tail_spans = tail_meta.get("version_spans") or (
        [{"start": 0, "version": tail_version}] if tail_version else None
    )
    meta = {**tail_meta, **head_meta, "resumed": int(head_meta.get("resumed") or 0) + 1}
    meta.pop("weight_version", None)  # the call's label is what began it, never a later part's
    if head_version is not None:
        meta["weight_version"] = head_version
    if spans and tail_spans:
        meta["version_spans"] = spans + [{**span, "start": span["start"] + n_head} for span in tail_spans]
    else:
        meta.pop("version_spans", None)
    triples = head_meta.get("output_token_logprobs"), tail_meta.get("output_token_logprobs")
    if all(isinstance(t, list) for t in triples):
        meta["output_token_logprobs"] = triples[0] + triples[1]
    else:
        meta.pop("output_token_logprobs", None)
    joined_choice = {
        **head,
        "message": {
            "role": "assistant",
            "content": parsed.content or (None if calls else ""),
            "reasoning_content": parsed.reasoning,
            "tool_calls": calls or None,
        },
        "finish_reason": "tool_calls" if calls and finish == "stop" else finish,
        "matched_stop": tail.get("matched_stop"),
        "response_token_ids": list(head["response_token_ids"]) + list(tail["response_token_ids"]),
        "meta_info": meta,
    }
    if head.get("logprobs") is not None or tail.get("logprobs") is not None:
        tail_entries = (tail.get("logprobs") or {}).get("content") or []
        joined_choice["logprobs"] = {"content": list(head_entries) + list(tail_entries)}
    return {**first, "choices": [joined_choice]}
