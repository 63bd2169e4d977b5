"""Merged sequences for the report's token viewer: a few sessions, decoded token by token.

Each token keeps its id, loss mask and recorded logprob (0.0 on mask-0 tokens); each turn's first sampled token
marks a turn boundary. Very long first prompts (a harness's system prompt) are shown head and tail only — every
sampled token comes after the first prompt, so nothing trainable is ever cut. The page opens each session's box on
its first sampled turn (`context_before` tokens in).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.report.collect import RunData, engine_info
from polar_mitm.storage.merged import MergedShards

LOGPROB_FLOOR = 10.0  # nats: the red end of the viewer's logprob colours
COLUMNS = (
    "sequence_id",
    "session_id",
    "task_id",
    "input_ids",
    "loss_mask",
    "logprobs",
    "prompt_len",
    "n_turns",
    "reward",
    "turn_starts",
)


@dataclass
class Token:
    text: str
    token_id: int
    mask: int
    logprob: float
    turn: int | None = None  # set on the first token of each turn (1-based)

    @property
    def shade(self) -> float:
        """0 (logprob ≤ -10) … 1 (logprob 0): the logprob colour scale. Logarithmic, because a small model's
        sampled tokens often have probabilities far below 1% where a linear scale shows one colour."""
        return min(1.0, max(0.0, 1.0 + self.logprob / LOGPROB_FLOOR))


@dataclass
class Trajectory:
    sequence_id: str
    session_id: str
    task_id: str
    reward: float | None
    n_turns: int
    tokens: list[Token] = field(default_factory=list)
    elided: tuple[int, int] | None = None  # (after token index, tokens left out) of the first prompt
    sampled: int = 0
    total: int = 0
    context_before: int = 0  # tokens before the first sampled one (the viewer opens there)


def load_report_tokenizer(run: RunData, spec: str | None):
    """The tokenizer to decode with: `spec`, else the engine's (recorded by the gateway), else a trained
    checkpoint's; None (ids only) when none loads."""
    candidates: list[str] = [spec] if spec else []
    info = engine_info(run)
    if info and info.get("tokenizer_path"):
        candidates.append(str(info["tokenizer_path"]))
    candidates += [
        str(s.train_dir) for s in run.stages if s.train_dir and (s.train_dir / "tokenizer.json").exists()
    ]
    from polar_mitm.reconstruct.merge import shared_tokenizer

    for candidate in candidates:
        try:
            # Loaded once per process (and shared with the merge): the loop rewrites its report every iteration.
            return shared_tokenizer(candidate)
        except (OSError, ValueError):  # a path from another machine, or not a tokenizer: try the next one
            continue
    return None


def pick_rows(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Up to `limit` sequences, one session each, spread over tasks and over high and low rewards."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(
        rows,
        key=lambda r: (
            -(r["reward"] if r["reward"] is not None else -math.inf),
            r["session_id"],
            r["sequence_id"],
        ),
    ):
        by_task.setdefault(row["task_id"] or "", []).append(row)
    picked: list[dict[str, Any]] = []
    sessions: set[str] = set()
    rounds = [[group[0], group[-1], *group[1:-1]] for group in by_task.values()]  # best, worst, then the rest
    for position in range(max((len(r) for r in rounds), default=0)):
        for group in rounds:
            if len(picked) >= limit:
                return picked
            if position < len(group) and group[position]["session_id"] not in sessions:
                picked.append(group[position])
                sessions.add(group[position]["session_id"])
    return picked


def read_trajectories(
    merged_dir: Path, tokenizer, *, limit: int = 6, max_prompt_tokens: int = 1200
) -> list[Trajectory]:
    """Decode up to `limit` sequences of the merged shards under `merged_dir`."""
    shards = MergedShards.at(merged_dir)  # only the shards: the folder also holds stats.png, report.html…
    columns = [c for c in COLUMNS if c in shards.dataset().schema.names]
    rows = shards.table(columns=columns).to_pylist()
    return [to_trajectory(row, tokenizer, max_prompt_tokens) for row in pick_rows(rows, limit)]


def to_trajectory(row: dict[str, Any], tokenizer, max_prompt_tokens: int) -> Trajectory:
    ids, mask, logprobs = row["input_ids"], row["loss_mask"], row["logprobs"]
    traj = Trajectory(
        sequence_id=row["sequence_id"],
        session_id=row["session_id"],
        task_id=row["task_id"] or "",
        reward=row["reward"],
        n_turns=row["n_turns"],
        sampled=sum(mask),
        total=len(ids),
        context_before=next((i for i, m in enumerate(mask) if m == 1), 0),
    )
    keep = list(range(len(ids)))
    prompt_len = row["prompt_len"]
    if prompt_len > max_prompt_tokens:
        head = max_prompt_tokens // 4
        tail_start = prompt_len - (max_prompt_tokens - head)
        keep = list(range(head)) + list(range(tail_start, len(ids)))
        traj.elided = (head, tail_start - head)
    texts = decode_each(tokenizer, [ids[i] for i in keep])
    starts = turn_starts(row)
    for text, i in zip(texts, keep, strict=True):
        turn = starts.index(i) + 1 if i in starts else None
        traj.tokens.append(
            Token(text=text, token_id=int(ids[i]), mask=int(mask[i]), logprob=float(logprobs[i]), turn=turn)
        )
    return traj


def turn_starts(row: dict[str, Any]) -> list[int]:
    """Where each turn's sampled tokens begin: the merged `turn_starts` column, else each mask-1 run's start."""
    if row.get("turn_starts"):
        return [int(s) for s in row["turn_starts"]]
    mask = row["loss_mask"]
    return [i for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0)]


def decode_each(tokenizer, ids: list[int]) -> list[str]:
    """Each id's own text (special tokens included); `⟨id⟩` when there is no tokenizer."""
    if tokenizer is None:
        return [f"⟨{i}⟩" for i in ids]
    return tokenizer.batch_decode(
        [[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
