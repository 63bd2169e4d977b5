"""SFT export: the successful trajectories (session reward ≥ R) as datasets TRL's `SFTTrainer` takes directly.

- `tokenized/`: the recorded tokens, exactly: `input_ids`, `assistant_masks` (= the loss mask: 1 on tokens the model
  sampled) and `labels` (the ids there, -100 elsewhere). No re-tokenisation, so nothing drifts from what was sampled.
- `messages/`: a `messages` + `tools` form, for ChatML (Qwen-style) tokenizers, only for sequences that render back
  to the very same token ids through the tokenizer's chat template — the rest are counted, not guessed.

Plus `counts.json`: attempted / accepted / acceptance rate, per task and in total (as the paper's table).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.storage.merged import MergedSequence
from polar_mitm.train.advantages import session_rewards
from polar_mitm.train.data import count_ones

IGNORE_INDEX = -100  # the label transformers' losses skip


@dataclass
class AcceptanceRow:
    """Sessions with a reward (attempted) and those at or above the threshold (accepted), for one task or all."""

    name: str
    attempted: int = 0
    accepted: int = 0
    sequences: int = 0
    sampled_tokens: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.attempted if self.attempted else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rate": self.rate}


@dataclass
class SftExport:
    """What `export_sft` wrote, and the acceptance table."""

    output_dir: Path
    min_reward: float
    total: AcceptanceRow
    per_task: list[AcceptanceRow] = field(default_factory=list)
    unrewarded_sessions: int = 0
    messages_rows: int | None = None  # None: no tokenizer given, or not a ChatML template
    messages_skipped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "output_dir": str(self.output_dir),
            "min_reward": self.min_reward,
            "total": self.total.to_dict(),
            "per_task": [row.to_dict() for row in self.per_task],
            "unrewarded_sessions": self.unrewarded_sessions,
            "messages_rows": self.messages_rows,
            "messages_skipped": self.messages_skipped,
        }


def select_successful(
    sequences: list[MergedSequence], min_reward: float
) -> tuple[list[MergedSequence], AcceptanceRow, list[AcceptanceRow], int]:
    """Sequences of sessions whose reward is ≥ `min_reward`, and the acceptance counts (per task, total)."""
    reward, task_of, _ = session_rewards(sequences)
    total = AcceptanceRow("total")
    per_task: dict[str, AcceptanceRow] = {}
    for session, value in reward.items():
        task = task_of[session] or "(no task_id)"
        row = per_task.setdefault(task, AcceptanceRow(task))
        for counts in (row, total):
            counts.attempted += 1
            counts.accepted += value >= min_reward
    accepted = [s for s in sequences if s.session_id in reward and reward[s.session_id] >= min_reward]
    for seq in accepted:
        task = task_of[seq.session_id] or "(no task_id)"
        for counts in (per_task[task], total):
            counts.sequences += 1
            counts.sampled_tokens += count_ones(seq.loss_mask)
    return accepted, total, sorted(per_task.values(), key=lambda r: r.name), len(task_of) - len(reward)


def tokenized_row(seq: MergedSequence, reward: float | None = None) -> dict[str, Any]:
    """One pre-tokenised SFT example: ids, the loss mask as `assistant_masks`, and `labels`."""
    return {
        "input_ids": list(seq.input_ids),
        "assistant_masks": list(seq.loss_mask),
        "labels": [
            tok if mask else IGNORE_INDEX for tok, mask in zip(seq.input_ids, seq.loss_mask, strict=True)
        ],
        "session_id": seq.session_id,
        "task_id": seq.task_id,
        "sequence_id": seq.sequence_id,
        "reward": reward if reward is not None else seq.reward,
    }


# -- messages form (ChatML) ------------------------------------------------------------------------------------------

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOLS_OPEN, TOOLS_CLOSE = "\n<tools>", "\n</tools>"
TOOLS_HEADER = "# Tools\n\n"


def chatml_messages(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Parse a rendered ChatML (Qwen-style) conversation into (messages, tools).

    Tool results rendered as `<tool_response>` blocks in a user turn become `tool` messages; assistant turns are
    split into reasoning, content and tool calls with the engine's own parsers. Every message has the same keys
    (role, content, reasoning_content, tool_calls; arguments as JSON text), so Arrow stores them without padding
    dicts with nulls. Raises ValueError when the text is not ChatML.
    """
    from polar_mitm.engine.parsers import parse_tool_calls, split_reasoning

    if not text.startswith(IM_START):
        raise ValueError("not a ChatML conversation")
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None

    def add(role: str, content: str, reasoning: str | None = None, calls: list | None = None) -> None:
        messages.append(
            {"role": role, "content": content, "reasoning_content": reasoning, "tool_calls": calls or []}
        )

    for block in text.split(IM_START)[1:]:
        body = block.split(IM_END, 1)[0]
        role, _, content = body.partition("\n")
        if role == "system" and TOOLS_OPEN in content:
            head, _, rest = content.partition(TOOLS_HEADER)
            listing = rest.split(TOOLS_OPEN, 1)[1].split(TOOLS_CLOSE, 1)[0]
            tools = [json.loads(line) for line in listing.strip().splitlines() if line.strip()]
            if head:
                add("system", head.removesuffix("\n\n"))
        elif role == "user" and content.startswith("<tool_response>\n"):  # tool results, as Qwen renders them
            for part in content.split("<tool_response>\n")[1:]:
                add("tool", part.split("\n</tool_response>", 1)[0])
        elif role == "assistant":
            reasoning, rest = split_reasoning(content, "qwen3")
            visible, calls = parse_tool_calls(rest, "qwen25")
            add(
                "assistant",
                visible,
                reasoning,
                [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls],
            )
        elif role in ("system", "user"):
            add(role, content)
        else:
            raise ValueError(f"unknown ChatML role {role!r}")
    return messages, tools


def messages_row(seq: MergedSequence, tokenizer) -> dict[str, Any] | None:
    """The sequence as `messages` + `tools` (JSON text, as TRL reads it), if that renders back to exactly its token
    ids through the tokenizer's chat template; else None."""
    text = tokenizer.decode(seq.input_ids, skip_special_tokens=False)
    try:
        messages, tools = chatml_messages(text)
        rendered = list(
            tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    ids = list(seq.input_ids)
    # The template closes every turn with "<|im_end|>\n"; a sampled turn ends at <|im_end|>.
    if rendered != ids and rendered[:-1] != ids:
        return None
    return {
        "messages": messages,
        "tools": json.dumps(tools) if tools else None,
        "session_id": seq.session_id,
        "task_id": seq.task_id,
        "sequence_id": seq.sequence_id,
        "reward": seq.reward,
    }


def export_sft(
    sequences: list[MergedSequence], output_dir: str | Path, *, min_reward: float, tokenizer=None
) -> SftExport:
    """Write `tokenized/` (always), `messages/` (with a ChatML tokenizer) and `counts.json` under `output_dir`.

    Both datasets load with `datasets.load_from_disk` and go straight into `SFTTrainer(train_dataset=...)`.
    """
    from datasets import Dataset

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    accepted, total, per_task, unrewarded = select_successful(sequences, min_reward)
    reward, _, _ = session_rewards(sequences)
    export = SftExport(
        output_dir=output_dir,
        min_reward=min_reward,
        total=total,
        per_task=per_task,
        unrewarded_sessions=unrewarded,
    )
    Dataset.from_list(
        [tokenized_row(s, reward.get(s.session_id)) for s in accepted], features=_tokenized_features()
    ).save_to_disk(output_dir / "tokenized")
    if tokenizer is not None and IM_START in (tokenizer.chat_template or ""):
        rows = [messages_row(s, tokenizer) for s in accepted]
        kept = [r for r in rows if r is not None]
        export.messages_rows, export.messages_skipped = len(kept), len(rows) - len(kept)
        if kept:
            Dataset.from_list(kept).save_to_disk(output_dir / "messages")
    (output_dir / "counts.json").write_text(json.dumps(export.to_dict(), indent=2))
    return export


def _tokenized_features():
    from datasets import Features, Sequence, Value

    return Features(
        {
            "input_ids": Sequence(Value("int32")),
            "assistant_masks": Sequence(Value("int8")),
            "labels": Sequence(Value("int32")),
            "session_id": Value("string"),
            "task_id": Value("string"),
            "sequence_id": Value("string"),
            "reward": Value("float64"),
        }
    )
