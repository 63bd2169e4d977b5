"""Resuming a call the engine aborted (issue 43): SGLang's weight update aborts every running request by default, and
any engine may abort a call the harness never gave up on. The gateway then sends prompt + the tokens sampled so far
back through the token-in path with the rest of the budget (`continuation_request`), at most `MAX_RESUMES` times,
and the harness's stream goes on where it stopped: one answer, one record (engines/stream.py joins the parts).

The continuation is asked for as raw text (`separate_reasoning: false`, `tool_choice: "none"`: SGLang's fields, the
embedded engine and the vLLM dialect honour them) and parsed here (`ResumedText`), by a parser that has first read
the text the harness was already sent — so reasoning cut by the abort stays reasoning, and a tool call whose
opening tag came before the abort is still a call. The parsers are the embedded engine's (engine/parsers.py), named
by the engine's model info as on the vLLM path.
"""

from __future__ import annotations

from typing import Any

from polar_mitm.engine.parsers import ParsedCall, TextStreamParser
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
