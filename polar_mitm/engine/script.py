"""Scripted policy for tests: the engine "writes" scripted assistant turns instead of sampling.

A random tiny model never calls tools, yet harness tests need a tool call and then a final answer. With a script,
turn k of a conversation (k = assistant turns already in the prompt) is the k-th scripted turn, tokenised by the
real tokenizer and followed by the end-of-turn token. Its logprobs are still the true log-probabilities of those
tokens under the model (the engine scores them during decoding), so records stay honest and the gateway cannot
tell a scripted turn from a sampled one.

Script file (JSON): either a list of turns, or an object

    {"turns": [...],                       # the main conversation, one item per assistant turn
     "side": "OK.",                        # answer to requests that offer no tools (titles, summaries, ...)
     "replies": [{"when": "Complexity Score", "text": "{...}"}]}  # answers chosen by the prompt's text
                                           # (a reply may hold any turn, and "turn": K to apply at turn K only)

A turn is a string (raw assistant text, e.g. `<tool_call>\\n{"name": ...}\\n</tool_call>`), `{"text": ...}`, or
`{"text": ..., "tool_call": CALL | [CALL, ...]}` with CALL = `{"name": NAME, "arguments": {...}}`. NAME may be a
list of candidates: the first one the request offers as a tool is called, with `arguments_by_name[NAME]` when
given (harnesses shape the same shell tool differently) and `arguments` otherwise. Requests that offer no tools
(side requests) never get a tool call: they get `side`, else the turn's own text. A `replies` entry whose `when`
occurs in the prompt text wins over all of that (e.g. the JSON a harness's routing classifier asks for, or a
compaction summary). After the last turn the script repeats its last turn.

A turn may also be `{"choices": [TURN, TURN, ...]}`: the engine then samples ONE of the candidate turns with
probability ∝ exp(sum of the logprobs of its tokens under the model, at the request's temperature) — the model's
own probability of each whole answer, restricted to the candidates (`choice_probabilities`). The recorded logprobs
are those same per-token logprobs, so a GRPO update that raises a token's logprob by x raises its candidate's odds
by e^x: training moves the choice exactly as it moves the model. (A per-token *mean* would divide that effect by
the answer's length.) Outcomes vary inside a GRPO group and training shifts the choice — this is what makes the
CPU demo learn something real. Write candidates of equal token length that differ in a token or two, so a random
model starts near an even choice; the importance ratios GRPO computes per token then omit only the normaliser
over the candidates (the same for every candidate of a call).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IM_START, ASSISTANT_TOKEN_TEXT = "<|im_start|>", "assistant"


class ScriptError(ValueError):
    """A script file that does not follow the format above."""


@dataclass
class ScriptedCall:
    """One tool call of a scripted turn; `names` are candidates, in order of preference."""

    names: list[str]
    arguments: dict[str, Any]
    arguments_by_name: dict[str, dict[str, Any]] = field(default_factory=dict)
    adaptive: bool = False  # written as a list of names: pick among the request's tools

    @classmethod
    def parse(cls, raw: Any) -> ScriptedCall:
        if not isinstance(raw, dict) or "name" not in raw:
            raise ScriptError(f"a tool_call needs a name: {raw!r}")
        names = raw["name"] if isinstance(raw["name"], list) else [raw["name"]]
        if not names or not all(isinstance(n, str) for n in names):
            raise ScriptError(f"tool_call name must be a string or a non-empty list of strings: {raw!r}")
        return cls(
            names=names,
            arguments=dict(raw.get("arguments") or {}),
            arguments_by_name=dict(raw.get("arguments_by_name") or {}),
            adaptive=isinstance(raw["name"], list),
        )

    def choose(self, offered: Sequence[str] | None) -> str | None:
        """The name to call given the request's tool names (None: unknown, take the first candidate)."""
        if offered is None or not self.adaptive:
            return self.names[0]
        return next((n for n in self.names if n in offered), None)

    def render(self, name: str) -> str:
        arguments = self.arguments_by_name.get(name, self.arguments)
        payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{payload}\n</tool_call>"


@dataclass
class ScriptedTurn:
    text: str = ""
    calls: list[ScriptedCall] = field(default_factory=list)

    @classmethod
    def parse(cls, item: Any) -> ScriptedTurn | ScriptedChoice:
        if isinstance(item, dict) and "choices" in item:
            choices = item["choices"]
            if not isinstance(choices, list) or not choices:
                raise ScriptError(f"choices must be a non-empty list of turns: {item!r}")
            return ScriptedChoice([cls._parse_one(c) for c in choices])
        return cls._parse_one(item)

    @classmethod
    def _parse_one(cls, item: Any) -> ScriptedTurn:
        if isinstance(item, str):
            return cls(text=item)
        if isinstance(item, dict) and ("tool_call" in item or "text" in item):
            raw_calls = item.get("tool_call") or []
            raw_calls = raw_calls if isinstance(raw_calls, list) else [raw_calls]
            return cls(text=str(item.get("text", "")), calls=[ScriptedCall.parse(c) for c in raw_calls])
        raise ScriptError(f"script item must be a string, {{'text': ...}} or {{'tool_call': ...}}: {item!r}")

    def render(self, offered: Sequence[str] | None) -> str | None:
        """The assistant text for a request offering `offered` tools; None when no candidate name is offered."""
        if not self.calls:
            return self.text
        names = [call.choose(offered) for call in self.calls]
        if any(n is None for n in names):
            return None
        blocks = [call.render(n) for call, n in zip(self.calls, names, strict=True) if n is not None]
        return (self.text + "\n" if self.text else "") + "\n".join(blocks)


@dataclass
class ScriptedChoice:
    """Candidate turns; the engine samples one by the model's probability of each."""

    alternatives: list[ScriptedTurn]


def choice_probabilities(candidate_logprobs: Sequence[Sequence[float]]) -> list[float]:
    """The model restricted to the candidates: P(c) ∝ exp(Σ logprobs of c's tokens), each at the sampling temperature.

    `candidate_logprobs[i]` are the per-token logprobs of candidate i (log_softmax(logits / T) at each of its
    tokens, the numbers the engine records). Computed in log space, so sums of hundreds of nats do not underflow.
    """
    if not candidate_logprobs:
        raise ValueError("no candidates")
    totals = [math.fsum(lps) for lps in candidate_logprobs]
    top = max(totals)
    weights = [math.exp(t - top) for t in totals]
    norm = math.fsum(weights)
    return [w / norm for w in weights]


def turn_text(item: Any, offered: Sequence[str] | None = None) -> str:
    """The raw assistant text of one script item (tool names chosen among `offered` when given)."""
    turn = ScriptedTurn.parse(item)
    if isinstance(turn, ScriptedChoice):
        turn = turn.alternatives[0]
    text = turn.render(offered)
    return turn.text if text is None else text


def read_script_file(path: str | Path) -> Any:
    """A script file's JSON; raises ScriptError naming the file when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ScriptError(f"script {path}: {exc}") from None


def called_tool_names(spec: list[Any] | dict[str, Any]) -> list[list[str]]:
    """The candidate names of every tool call a script can make (its turns, choices and replies)."""
    spec = {"turns": spec} if isinstance(spec, list) else spec
    items = list(spec.get("turns") or []) if isinstance(spec, dict) else []
    for reply in spec.get("replies") or [] if isinstance(spec, dict) else []:
        if isinstance(reply, dict):
            items.append({k: v for k, v in reply.items() if k not in ("when", "turn")})
    names: list[list[str]] = []
    for item in items:
        turn = ScriptedTurn.parse(item)
        for one in turn.alternatives if isinstance(turn, ScriptedChoice) else [turn]:
            names.extend(call.names for call in one.calls)
    return names


class Script:
    """Maps a prompt (and the request's tool names) to the scripted token ids of its next assistant turn."""

    def __init__(self, spec: list[Any] | dict[str, Any], tokenizer, eos_id: int) -> None:
        if isinstance(spec, list):
            spec = {"turns": spec}
        turns = spec.get("turns") if isinstance(spec, dict) else None
        if not turns or not isinstance(turns, list):
            raise ScriptError("a script needs at least one turn")
        self.turns = [ScriptedTurn.parse(t) for t in turns]
        self.side: str | None = spec.get("side")
        replies = spec.get("replies") or []
        if not all(
            isinstance(r, dict) and "when" in r and ({"text", "tool_call", "choices"} & r.keys())
            for r in replies
        ):
            raise ScriptError(
                f"replies must be objects with `when` and a turn (text/tool_call/choices): {replies!r}"
            )
        # (substring of the prompt, only at this turn index or any, the turn to play)
        self.replies: list[tuple[str, int | None, ScriptedTurn | ScriptedChoice]] = [
            (
                str(r["when"]),
                r.get("turn"),
                ScriptedTurn.parse({k: v for k, v in r.items() if k not in ("when", "turn")}),
            )
            for r in replies
        ]
        self.tokenizer, self.eos_id = tokenizer, eos_id
        start = tokenizer.convert_tokens_to_ids(IM_START)
        role = tokenizer.encode(ASSISTANT_TOKEN_TEXT, add_special_tokens=False)
        self.marker = [start, *role]
        self._ids: dict[str, list[int]] = {}

    @classmethod
    def load(cls, path: str | Path, tokenizer, eos_id: int) -> Script:
        return cls(read_script_file(path), tokenizer, eos_id)

    def turn_index(self, prompt_ids: list[int]) -> int:
        """Assistant turns already in the prompt (the generation prompt's own header is not counted)."""
        m, n = self.marker, len(self.marker)
        count = sum(1 for i in range(len(prompt_ids) - n + 1) if prompt_ids[i : i + n] == m)
        return max(count - 1, 0)

    def answered(self, prompt_ids: list[int]) -> list[int]:
        """The tokens of the current turn the prompt already holds after its assistant header (and newline): a
        call resumed after an abort (the gateway resubmits prompt + the tokens sampled so far) continues the turn."""
        m, n = self.marker, len(self.marker)
        for i in range(len(prompt_ids) - n, -1, -1):
            if prompt_ids[i : i + n] == m:
                return prompt_ids[i + n + 1 :]
        return []

    def texts_for(self, prompt_ids: list[int], tool_names: Sequence[str] | None = None) -> list[str]:
        """Candidate assistant texts of the next turn (one unless the turn is a `choices` turn).

        `tool_names` = the request's tools ([] none, None unknown).
        """
        index = self.turn_index(prompt_ids)
        turn: ScriptedTurn | ScriptedChoice | None = None
        if self.replies:
            prompt = self.tokenizer.decode(prompt_ids)
            turn = next((t for when, at, t in self.replies if when in prompt and at in (None, index)), None)
        replied = turn is not None
        if turn is None:
            turn = self.turns[min(index, len(self.turns) - 1)]
        options = turn.alternatives if isinstance(turn, ScriptedChoice) else [turn]
        texts = []
        for option in options:
            side_request = tool_names is not None and not tool_names
            if (
                replied and not option.calls
            ):  # a plain-text reply wins over everything, side requests included
                text = option.text
            else:
                text = None if side_request else option.render(tool_names)
            if text is None:  # a side request, or none of the candidate tools is offered (a sub-agent)
                text = self.side if self.side is not None else option.text
            if text not in texts:
                texts.append(text)
        return texts

    def text_for(self, prompt_ids: list[int], tool_names: Sequence[str] | None = None) -> str:
        """The first candidate text of the next turn."""
        return self.texts_for(prompt_ids, tool_names)[0]

    def candidate_ids_for(
        self, prompt_ids: list[int], tool_names: Sequence[str] | None = None
    ) -> list[list[int]]:
        """Token ids (ending with the end-of-turn token) of each candidate for the next turn."""
        out = []
        for text in self.texts_for(prompt_ids, tool_names):
            if text not in self._ids:
                self._ids[text] = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_id]
            out.append(self._ids[text])
        return out

    def ids_for(self, prompt_ids: list[int], tool_names: Sequence[str] | None = None) -> list[int]:
        return self.candidate_ids_for(prompt_ids, tool_names)[0]
