"""SFT export: successful trajectories → datasets SFTTrainer trains on directly, with the acceptance table."""

from __future__ import annotations

import json

import pytest
from datasets import load_from_disk
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.storage.merged import MergedSequence
from polar_mitm.train.sft import IGNORE_INDEX, chatml_messages, export_sft

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Write hello into out.txt"},
    {
        "role": "assistant",
        "content": "Let me write the file.",
        "reasoning_content": "A shell call does it.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "shell", "arguments": '{"command": "echo hello > out.txt"}'},
            }
        ],
    },
    {"role": "tool", "content": "(no output)"},
    {"role": "assistant", "content": "Done: out.txt now says hello.", "reasoning_content": "It worked."},
]


def render(tokenizer, messages, **kwargs) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=False, **kwargs)
    )


def agent_sequence(tokenizer, session: str, task: str, reward: float | None) -> MergedSequence:
    """A two-turn tool-calling session as prefix_merging builds it: loss mask 1 on each assistant body."""
    ids = render(tokenizer, CONVERSATION)[:-1]  # ends at the last sampled <|im_end|>, not the template's "\n"
    mask = [0] * len(ids)
    for k, message in enumerate(CONVERSATION):
        if message["role"] == "assistant":
            start = len(render(tokenizer, CONVERSATION[:k], add_generation_prompt=True))
            end = len(render(tokenizer, CONVERSATION[: k + 1])) - 1
            assert render(tokenizer, CONVERSATION[: k + 1])[:end] == ids[:end]  # prefix-preserving template
            mask[start:end] = [1] * (end - start)
    logprobs = [-1.0 if m else 0.0 for m in mask]
    return MergedSequence(
        sequence_id=f"{session}-0",
        session_id=session,
        task_id=task,
        input_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        prompt_len=mask.index(1),
        request_ids=["a", "b"],
        n_turns=2,
        builder="prefix_merging",
        reward=reward,
    )


def raw_sequence(session: str, task: str, reward: float | None) -> MergedSequence:
    """Ids that are not a chat: exported tokenised, never guessed into messages."""
    return MergedSequence(
        sequence_id=f"{session}-0",
        session_id=session,
        task_id=task,
        input_ids=[10, 11, 12, 13],
        loss_mask=[0, 0, 1, 1],
        logprobs=[0.0, 0.0, -1.0, -2.0],
        prompt_len=2,
        request_ids=["r"],
        n_turns=1,
        builder="per_request",
        reward=reward,
    )


@pytest.fixture
def sequences(tiny_engine) -> list[MergedSequence]:
    tok = tiny_engine.tokenizer
    return [
        agent_sequence(tok, "a1", "write", 1.0),
        agent_sequence(tok, "a2", "write", 0.0),
        agent_sequence(tok, "a3", "write", 1.0),
        raw_sequence("b1", "raw", 1.0),
        raw_sequence("b2", "raw", 0.2),
        raw_sequence("c1", "raw", None),
    ]


def test_export_counts_and_tokenised_rows(sequences, tiny_engine, tmp_path):
    export = export_sft(sequences, tmp_path / "sft", min_reward=1.0, tokenizer=tiny_engine.tokenizer)
    assert (export.total.attempted, export.total.accepted) == (5, 3)
    assert export.total.rate == pytest.approx(0.6)
    assert {r.name: (r.attempted, r.accepted) for r in export.per_task} == {"write": (3, 2), "raw": (2, 1)}
    assert export.unrewarded_sessions == 1
    tokenized = load_from_disk(str(tmp_path / "sft" / "tokenized"))
    assert sorted(tokenized["session_id"]) == ["a1", "a3", "b1"]
    by_session = {seq.session_id: seq for seq in sequences}
    for row in tokenized:
        seq = by_session[row["session_id"]]
        assert row["input_ids"] == seq.input_ids and row["assistant_masks"] == seq.loss_mask
        assert row["labels"] == [
            t if m else IGNORE_INDEX for t, m in zip(seq.input_ids, seq.loss_mask, strict=True)
        ]
    counts = json.loads((tmp_path / "sft" / "counts.json").read_text())
    assert counts["total"]["rate"] == pytest.approx(0.6)
    # Messages: only the chats that render back to their exact ids.
    assert (export.messages_rows, export.messages_skipped) == (2, 1)
    messages = load_from_disk(str(tmp_path / "sft" / "messages"))
    row = messages[0]
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert row["messages"][2]["tool_calls"][0]["function"] == CONVERSATION[2]["tool_calls"][0]["function"]
    assert json.loads(row["tools"]) == TOOLS


def test_chatml_parse_renders_back_to_the_same_ids(tiny_engine):
    tok = tiny_engine.tokenizer
    ids = render(tok, CONVERSATION)
    messages, tools = chatml_messages(tok.decode(ids, skip_special_tokens=False))
    assert tools == TOOLS
    assert list(tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)) == ids


@pytest.mark.slow
def test_sft_trainer_takes_both_exports_directly(sequences, tiny_engine, tiny_model_dir, tmp_path):
    from trl import SFTConfig, SFTTrainer

    export_sft(sequences, tmp_path / "sft", min_reward=1.0, tokenizer=tiny_engine.tokenizer)
    for form in ("tokenized", "messages"):
        dataset = load_from_disk(str(tmp_path / "sft" / form))
        config = SFTConfig(
            output_dir=str(tmp_path / f"out-{form}"),
            max_steps=1,
            per_device_train_batch_size=2,
            report_to=[],
            bf16=False,
            activation_checkpointing=False,
            disable_tqdm=True,
            assistant_only_loss=False,
            dataset_num_proc=None,
        )
        trainer = SFTTrainer(model=str(tiny_model_dir), args=config, train_dataset=dataset)
        if form == "messages":  # TRL's own tokenisation of the messages form gives the recorded ids back
            recorded = {s.session_id: s.input_ids for s in sequences}
            for row, session in zip(trainer.train_dataset, dataset["session_id"], strict=True):
                assert row["input_ids"][: len(recorded[session])] == recorded[session]
        else:  # our labels are used as given: loss on sampled tokens only
            assert trainer.train_dataset[0]["labels"] == dataset[0]["labels"]
        result = trainer.train()
        assert result.training_loss > 0


def test_sft_command_prints_the_acceptance_table(sequences, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from polar_mitm.storage.merged import MERGED_SCHEMA

    (tmp_path / "merged").mkdir()
    pq.write_table(
        pa.Table.from_pylist([s.to_row() for s in sequences], schema=MERGED_SCHEMA),
        tmp_path / "merged" / "part-0.parquet",
    )
    result = CliRunner().invoke(
        app,
        [
            "sft",
            "--data",
            str(tmp_path / "merged"),
            "--min-reward",
            "1.0",
            "-o",
            str(tmp_path / "sft"),
            "--model",
            "tiny",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "attempted" in result.output and "60.0%" in result.output
    assert (tmp_path / "sft" / "tokenized").exists() and (tmp_path / "sft" / "messages").exists()
