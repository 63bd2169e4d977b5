"""Trainer correctness (issue 17): each row is scored at its own sampling temperature, greedy and truncated calls
stay out of the loss, every row is used equally often, sessions weigh the same under per-sequence losses, the KL
cannot turn a context token into a NaN, and wrong behaviour logprobs are reported on every step.

Rows come from the real path where it matters (the official `openai` SDK → gateway → scripted tiny engine →
records → `merge`), and otherwise are scored in-process by the same tiny model (exact behaviour logprobs).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.agent.sdk_agent import base_url_for
from polar_mitm.reconstruct.merge import merge_table
from polar_mitm.reconstruct.prefix_merging import eot_from_tokenizer
from polar_mitm.reconstruct.turns import sequences_from_table
from polar_mitm.session_ids import SessionId
from polar_mitm.storage.merged import MERGED_SCHEMA, MergedSequence
from polar_mitm.storage.records import read_all
from polar_mitm.train.batching import LengthBucketSampler, collate, length_buckets, padding_sources
from polar_mitm.train.data import build_training_data, load_sequences
from polar_mitm.train.grpo_config import PolarGRPOConfig
from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

pytestmark = pytest.mark.slow

RATIO_TOL = 1e-4
USER_TEXT = "Write hello into out.txt"


# -- rows through the real gateway ----------------------------------------------------------------------------------


def chat_session(gateway, task: str, session: str, sampling: list[dict]) -> None:
    """One session by the official openai SDK through the reverse gateway: one call per entry of `sampling` (the
    request's own sampling fields, e.g. `{"temperature": 0.7}`), each call continuing the previous answer."""
    import openai

    base_url = base_url_for("openai_chat", gateway.reverse_url, SessionId(session, task).path_prefix)
    client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0)
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": USER_TEXT},
    ]
    for fields in sampling:
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, **fields)
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": "Go on."},
        ]


SESSIONS: dict[str, tuple[str, list[dict]]] = {  # session → (task, sampling per call)
    **{f"t07-{g}": ("task-t07", [{"temperature": 0.7}] * (1 + g % 2)) for g in range(4)},
    **{f"t13-{g}": ("task-mixed", [{"temperature": 1.3}]) for g in range(2)},
    "mixed-turns": ("task-mixed", [{"temperature": 0.7}, {"temperature": 1.2}]),
    "greedy-0": ("task-greedy", [{"temperature": 0}]),
    "greedy-then-sampled": ("task-greedy", [{"temperature": 0}, {"temperature": 0.8}]),
    "top-p": ("task-greedy", [{"temperature": 0.8, "top_p": 0.9}]),
    "sampled-0": ("task-greedy", [{"temperature": 0.8}]),
}


@pytest.fixture(scope="module")
def captured(gateway, tiny_engine) -> dict[str, MergedSequence]:
    """The sessions above, captured and merged with prefix_merging; rewards vary inside each task."""
    for session, (task, sampling) in SESSIONS.items():
        chat_session(gateway, task, f"ic17-{session}", sampling)
    records = read_all(gateway.out_dir)
    ours = records.filter(
        pc.is_in(records["session_id"], value_set=pa.array([f"ic17-{s}" for s in SESSIONS]))
    )
    merged, _ = merge_table(
        ours, builder="prefix_merging", eot_token_id=eot_from_tokenizer(tiny_engine.tokenizer)
    )
    out = {}
    for i, seq in enumerate(sequences_from_table(merged)):
        name = seq.session_id.removeprefix("ic17-")
        out[name] = replace(seq, reward=float(i % 3) / 2)
    assert set(out) == set(SESSIONS)  # one sequence per session (every later turn extends the first)
    return out


def make_trainer(sequences: list[MergedSequence], out: Path, **overrides) -> PolarGRPOTrainer:
    from polar_mitm.engine.model_zoo import resolve_model

    settings_ = dict(
        output_dir=str(out),
        per_device_train_batch_size=len(sequences),
        max_steps=1,
        report_to=[],
        disable_tqdm=True,
        learning_rate=1e-2,
        seed=0,
    )
    settings_.update(overrides)
    data_options = {k: settings_.pop(k) for k in ("keep_truncated_sampling",) if k in settings_}
    return PolarGRPOTrainer(
        str(resolve_model("tiny")),
        args=PolarGRPOConfig(**settings_),
        train_data=build_training_data(sequences, **data_options),
    )


def step0_ratios(trainer: PolarGRPOTrainer) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """π_θ / π_behaviour per completion position at step 0 (TRL's logprob path at each row's temperatures)."""
    batch = trainer._generate_and_score_completions(trainer.train_data.rows)
    logps = trainer.policy_logps(batch)
    return torch.exp(logps - batch["sampling_per_token_logps"]), batch["tool_mask"].bool(), batch


def metrics(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_rows_sampled_at_t07_through_the_gateway_have_step0_ratio_1_with_the_default_config(
    captured, tmp_path
):
    rows = [captured[f"t07-{g}"] for g in range(4)]
    assert all(t == pytest.approx(0.7) for s in rows for t in s.turn_temperature)
    assert any(s.n_turns == 2 for s in rows)
    trainer = make_trainer(rows, tmp_path / "run")  # the default config: temperature 1.0
    assert trainer.args.temperature == 1.0
    ratio, mask, _ = step0_ratios(trainer)
    assert int(mask.sum()) == sum(sum(s.loss_mask) for s in rows)
    worst = float((ratio[mask] - 1).abs().max())
    assert worst <= RATIO_TOL, f"median ratio {float(ratio[mask].median()):.4f}, worst |ratio-1| {worst:.4f}"
    trainer.train()
    (first,) = metrics(tmp_path / "run")
    assert first["logp_diff/fresh_max"] <= RATIO_TOL and first["logp_diff/frac_checked"] == 1.0


def test_mixed_temperatures_rows_and_turns_each_get_ratio_1(captured, tmp_path):
    rows = [captured[s] for s in ("t07-0", "t07-1", "t13-0", "t13-1", "mixed-turns")]
    assert captured["mixed-turns"].turn_temperature == [pytest.approx(0.7), pytest.approx(1.2)]
    trainer = make_trainer(rows, tmp_path / "run")
    ratio, mask, _ = step0_ratios(trainer)
    for i, row in enumerate(trainer.train_data.rows):
        worst = float((ratio[i][mask[i]] - 1).abs().max())
        assert worst <= RATIO_TOL, (row["session_id"], worst)
    assert trainer.train_data.stats.temperatures == {"0.7": 4, "1.2": 1, "1.3": 2}  # turns per temperature


def test_greedy_and_truncated_calls_are_excluded_from_the_loss_and_counted(captured, tmp_path):
    sessions = ["greedy-0", "greedy-then-sampled", "top-p", "sampled-0"]
    rows = [captured[s] for s in sessions]
    assert captured["greedy-0"].turn_greedy == [True] and captured["top-p"].turn_top_p == [pytest.approx(0.9)]
    data = build_training_data(rows)
    stats = data.stats.to_dict()
    assert stats["excluded_greedy_turns"] == 2 and stats["excluded_truncated_turns"] == 1
    assert stats["dropped_excluded_sampling"] == 2  # greedy-0 and top-p have nothing else to train on
    kept = {r["session_id"].removeprefix("ic17-"): r for r in data.rows}
    assert set(kept) == {"greedy-then-sampled", "sampled-0"}
    mixed, source = kept["greedy-then-sampled"], captured["greedy-then-sampled"]
    second_turn = source.turn_starts[1]
    assert sum(mixed["loss_mask"]) == sum(source.loss_mask[second_turn:])  # only the sampled turn trains
    assert stats["excluded_sampled_tokens"] == sum(sum(captured[s].loss_mask) for s in sessions) - sum(
        sum(r["loss_mask"]) for r in data.rows
    )
    # Kept on request: greedy turns are scored at T=1 (what the engine recorded), truncated ones at their T.
    trainer = make_trainer(rows, tmp_path / "keep", keep_truncated_sampling=True)
    assert trainer.train_data.stats.excluded_greedy_turns == 0 and len(trainer.train_data.rows) == 4
    ratio, mask, _ = step0_ratios(trainer)
    assert float((ratio[mask] - 1).abs().max()) <= RATIO_TOL


# -- in-process rows (exact behaviour logprobs from the same tiny model) ------------------------------------------


def scored(
    engine,
    task: str,
    session: str,
    completion_texts: list[str],
    *,
    temperature: float = 1.0,
    reward: float = 0.0,
    suffix: str = "",
    shift: float = 0.0,
) -> MergedSequence:
    """A merged sequence as if sampled: prompt, then per turn a context (after the first) and sampled ids scored by
    the model at `temperature`."""
    tok = engine.tokenizer
    ids = list(
        tok.apply_chat_template(
            [{"role": "user", "content": f"{USER_TEXT}{suffix}"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    mask, logprobs, starts = [0] * len(ids), [0.0] * len(ids), []
    prompt_len = len(ids)
    for k, text in enumerate(completion_texts):
        if k:
            context = tok.encode(
                "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n",
                add_special_tokens=False,
            )
            ids += context
            mask += [0] * len(context)
            logprobs += [0.0] * len(context)
        sampled = tok.encode(text, add_special_tokens=False)
        starts.append(len(ids))
        lps = engine.score(ids, sampled, temperature=temperature)
        ids += sampled
        mask += [1] * len(sampled)
        logprobs += [lp + shift for lp in lps]
    n = len(completion_texts)
    return MergedSequence(
        sequence_id=f"{session}:r0",
        session_id=session,
        task_id=task,
        input_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        prompt_len=prompt_len,
        request_ids=[f"{session}-r{k}" for k in range(n)],
        n_turns=n,
        builder="prefix_merging",
        weight_version_min="0",
        weight_version_max="0",
        reward=reward,
        turn_starts=starts,
        turn_temperature=[temperature] * n,
        turn_top_p=[1.0] * n,
        turn_top_k=[-1] * n,
        turn_min_p=[0.0] * n,
        turn_greedy=[False] * n,
    )


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 70),
    batch=st.integers(1, 16),
    seed=st.integers(0, 3),
    spread=st.integers(1, 50),
    repeat=st.integers(1, 3),
)
def test_sampler_uses_every_row_exactly_once_per_epoch_without_padding_repeats(
    n, batch, seed, spread, repeat
):
    lengths = [(i * 7919) % spread + 1 for i in range(n)]
    chunks = length_buckets(lengths, batch, seed=seed)
    sources = padding_sources(lengths, batch)
    assert all(len(c) == batch for c in chunks)
    used = Counter(i for c in chunks for i in c)
    assert {i: used[i] for i in range(n)} == dict.fromkeys(range(n), 1)  # every row once, none twice
    assert set(used) == set(range(n + len(sources))) and len(sources) == (-n) % batch
    if n >= batch:  # padding never repeats a row inside its batch when the data allows it
        for c in chunks:
            rows = [sources[i - n] if i >= n else i for i in c]
            assert len(set(rows)) == len(rows)
    sampler = LengthBucketSampler(lengths, batch, repeat_count=repeat, seed=seed)
    for _epoch in range(2):
        stream = list(sampler)
        assert len(stream) == len(sampler)
        counts = Counter(i for i in stream if i < n)
        assert set(counts.values()) == {repeat} and len(counts) == n


def test_grpo_loss_gives_a_session_split_in_3_sequences_the_weight_of_one(tiny_engine, tmp_path):
    # Session "split" has three sequences, session "whole" one; all four hold the same tokens. Rewards 1 and 0 give
    # advantages +a and -a: with one unit of weight per session the two sessions' gradients cancel exactly.
    split = [
        replace(scored(tiny_engine, "task", "split", ["Done."], reward=1.0), sequence_id=f"split:{k}")
        for k in range(3)
    ]
    whole = scored(tiny_engine, "task", "whole", ["Done."], reward=0.0)

    def grad_norm(**overrides) -> float:
        trainer = make_trainer([*split, whole], tmp_path / str(len(overrides)), loss_type="grpo", **overrides)
        batch = trainer._generate_and_score_completions(trainer.train_data.rows)
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, batch).backward()
        return float(
            torch.sqrt(sum((p.grad**2).sum() for p in trainer.model.parameters() if p.grad is not None))
        )

    weighted = grad_norm()
    unweighted = grad_norm(session_weighting=False)
    assert unweighted > 1e-3
    assert weighted <= 1e-6 * unweighted, (weighted, unweighted)


def test_kl_with_a_200_nat_gap_on_a_context_token_keeps_loss_and_gradients_finite(tiny_engine, tmp_path):
    rows = [
        scored(tiny_engine, "task", f"s{g}", ["Sure.", "Done."], reward=float(g), suffix=" " * g)
        for g in range(2)
    ]
    trainer = make_trainer(rows, tmp_path / "run", beta=0.04)
    batch = trainer._generate_and_score_completions(trainer.train_data.rows)
    context = (batch["completion_mask"].bool() & ~batch["tool_mask"].bool()).nonzero()
    assert len(context)
    i, j = (int(x) for x in context[0])
    reference = batch["ref_per_token_logps"].clone()
    gapped = dict(batch, ref_per_token_logps=reference.clone())
    gapped["ref_per_token_logps"][i, j] = trainer.policy_logps(batch)[i, j] + 200.0
    losses = []
    for inputs in (batch, gapped):
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)
        losses.append(float(loss))
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)  # a token outside the loss changes nothing


def test_shifted_behaviour_logprobs_are_reported_on_every_step(tiny_engine, tmp_path):
    rows = [
        scored(
            tiny_engine,
            f"task-{g // 2}",
            f"s{g}",
            ["Sure, writing it now."],
            reward=float(g % 2),
            suffix=" " * g,
            shift=1.0,
        )
        for g in range(4)
    ]
    run = tmp_path / "run"
    trainer = make_trainer(rows, run, per_device_train_batch_size=2, max_steps=3)
    trainer.train()
    steps = metrics(run)
    assert [s["step"] for s in steps] == [1, 2, 3]
    for step in steps:
        assert step["logp_diff/fresh_mean"] == pytest.approx(1.0, abs=1e-3), step
        assert step["logp_diff/frac_over_threshold"] == 1.0, step
    report = json.loads((run / "behaviour_check.json").read_text())
    assert report["rows_checked"] == 4 and report["rows_over_threshold"] == 4
    assert {r["session_id"] for r in report["worst_rows"]} == {"s0", "s1", "s2", "s3"}


def test_v1_merged_files_read_with_unknown_temperature_scored_at_the_global_one(tiny_engine, tmp_path):
    seq = scored(tiny_engine, "task", "old", ["Done."], temperature=0.7)
    v1_fields = [f for f in MERGED_SCHEMA if not f.name.startswith("turn_")]
    row = {f.name: getattr(seq, f.name) for f in v1_fields} | {"schema_version": 1}
    pq.write_table(pa.Table.from_pylist([row], schema=pa.schema(v1_fields)), tmp_path / "v1.parquet")
    (old,) = load_sequences(tmp_path)
    assert old.turn_temperature is None and old.turn_starts is None
    data = build_training_data([old])
    assert data.stats.unknown_temperature_sequences == 1 and data.stats.temperatures == {"unknown": 1}
    batch = collate(data.rows, pad_token_id=0, default_temperature=0.7)
    assert torch.allclose(batch["token_temperature"], torch.tensor(0.7))
