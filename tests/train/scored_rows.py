"""Merged sequences as the engine would have recorded them, scored in-process by the tiny model (exact behaviour
logprobs), for the trainer tests that need no gateway: the optimizer across trainings, resume, off-policy bounds."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from polar_mitm.storage.merged import MERGED_SCHEMA, MergedSequence

ANSWERS = ["Sure, writing it now.", "Done.", "I will list the files.", "It is 4."]


def scored_sequence(
    engine,
    task: str,
    session: str,
    answer: str,
    *,
    reward: float,
    weight_version: str = "0",
    logprob_shift: float = 0.0,
) -> MergedSequence:
    """One sampled turn after a chat prompt, its behaviour logprobs the model's own at T = 1 (+ `logprob_shift`)."""
    tokenizer = engine.tokenizer
    prompt = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Task {task}: write hello into out.txt"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    sampled = tokenizer.encode(answer, add_special_tokens=False)
    logprobs = [lp + logprob_shift for lp in engine.score(prompt, sampled, temperature=1.0)]
    return MergedSequence(
        sequence_id=f"{session}:r0",
        session_id=session,
        task_id=task,
        input_ids=prompt + sampled,
        loss_mask=[0] * len(prompt) + [1] * len(sampled),
        logprobs=[0.0] * len(prompt) + logprobs,
        prompt_len=len(prompt),
        request_ids=[f"{session}-r0"],
        n_turns=1,
        builder="prefix_merging",
        weight_version_min=weight_version,
        weight_version_max=weight_version,
        reward=reward,
        turn_starts=[len(prompt)],
        turn_temperature=[1.0],
        turn_top_p=[1.0],
        turn_top_k=[-1],
        turn_min_p=[0.0],
        turn_greedy=[False],
    )


def task_groups(
    engine, tasks: int, group_size: int = 2, *, prefix: str = "", **options
) -> list[MergedSequence]:
    """`tasks` groups of `group_size` sessions with rewards 0, 1, 0, … (every group has a baseline to move)."""
    return [
        scored_sequence(
            engine,
            f"{prefix}task-{t}",
            f"{prefix}s{t}-{g}",
            ANSWERS[(t + g) % len(ANSWERS)],
            reward=float(g % 2),
            **options,
        )
        for t in range(tasks)
        for g in range(group_size)
    ]


def write_merged(sequences: list[MergedSequence], directory: Path) -> Path:
    """The sequences as one merged shard in `directory` (what `polar-mitm merge` writes)."""
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist([s.to_row() for s in sequences], schema=MERGED_SCHEMA),
        directory / "part-0.parquet",
    )
    return directory
