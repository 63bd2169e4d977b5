"""The capstone's warm start (issue 46): a model taught to use a real harness's tool by supervised training on
trajectories the pipeline itself recorded, before RL.

One command, five stages, each a real part of polar-mitm:

1. tasks — `polar-mitm tasks generate` families (default: the file tasks write, append, rename, fix) with the same
   seed as the RL run, so the held-out split is the one RL is evaluated on; only training tasks are taught;
2. rollout — the real harness (default Pi) answered by the teacher (polar_mitm/tasks/teacher.py: the engine plays
   the shell command that solves each training task, in the student's own tokenizer), graded by each task's check;
3. merge — prefix_merging of the records, with the rewards;
4. sft — `polar-mitm sft`: the sessions that passed, sampled tokens as labels, everything else masked;
5. train — TRL's SFTTrainer on that export, saved as a checkpoint the loop (or vLLM) starts from;
6. evaluate — the held-out tasks sampled freely (our CPU engine, no script) by the starting model and by the
   checkpoint: pass@1 (clustered by task), the share of sessions with a parsed tool call, unparsed tool calls.

    .venv/bin/python benchmarks/warm_start.py --run-dir runs/warm-start            # SmolLM2 through Pi
    .venv/bin/python benchmarks/warm_start.py --run-dir /tmp/w --model tiny --train-tasks 2 --epochs 1

RUN/model is the checkpoint; RUN/warm_start.json the figures (sessions the teacher passed, sequences and tokens
trained, the loss at the first and last logged step, seconds per stage). No held-out prompt is in the teacher's
script (checked before anything runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SUMMARY_FILE = "warm_start.json"
FILE_FAMILIES = "write,append,rename,fix"


def polar_mitm(*args: str, log: Path, env: dict[str, str] | None = None) -> None:
    """One `polar-mitm` command as a user runs it; its output goes to `log`, a failure ends the run with it."""
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "polar_mitm.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(
            f"warm start: `polar-mitm {args[0]}` failed (exit {done.returncode}); see {log}\n{tail}"
        )


def teach(args: argparse.Namespace) -> dict:
    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.tasks.generated import generate, write_split
    from polar_mitm.tasks.teacher import teacher_script

    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    families = [f.strip() for f in args.families.split(",") if f.strip()]

    started = time.monotonic()
    split = generate(families, args.train_tasks, args.held_out_tasks, args.seed)
    train, _held_out = write_split(split, run_dir / "tasks")
    script = teacher_script(split.train)
    taught = json.dumps(script)
    leaked = [t["task_id"] for t in split.held_out if t["prompt"] in taught]
    if leaked:  # the teacher knows training tasks only
        raise SystemExit(f"warm start: held-out tasks in the teacher's script: {leaked}")
    (run_dir / "teacher.json").write_text(json.dumps(script, indent=1))
    seconds["tasks"] = time.monotonic() - started

    started = time.monotonic()
    rewards = run_dir / "rewards.parquet"
    polar_mitm(
        "rollout", str(train), "--harness", args.harness, "--model", args.model,
        "--script", str(run_dir / "teacher.json"), "-g", str(args.group_size), "-c", str(args.concurrency),
        "--out", str(run_dir / "flows"), "--rewards", str(rewards), "--work-dir", str(run_dir / "rollout"),
        "--log-format", "lines",
        log=run_dir / "rollout.log",
    )  # fmt: skip
    seconds["rollout"] = time.monotonic() - started

    started = time.monotonic()
    polar_mitm(
        "merge", str(run_dir / "flows"), "--rewards", str(rewards), "-o", str(run_dir / "merged"),
        "--tokenizer", args.model, "--overwrite",
        log=run_dir / "merge.log",
    )  # fmt: skip
    polar_mitm(
        "sft", "--data", str(run_dir / "merged"), "-o", str(run_dir / "sft"), "--model", args.model,
        log=run_dir / "sft.log",
    )  # fmt: skip
    seconds["merge+sft"] = time.monotonic() - started

    started = time.monotonic()
    model_dir = resolve_model(args.model)
    training = train_sft(run_dir / "sft" / "tokenized", model_dir, run_dir / "model", args)
    seconds["train"] = time.monotonic() - started

    evaluations = {}
    if (
        args.eval_samples > 0
    ):  # the held-out split, sampled freely by the start and by the warm-started weights
        for stage, model in (("start", args.model), ("warm_start", str(run_dir / "model"))):
            started = time.monotonic()
            evaluations[stage] = evaluate(
                run_dir / f"eval-{stage}", run_dir / "tasks" / "held_out.jsonl", model, args
            )
            seconds[f"eval_{stage}"] = time.monotonic() - started

    import pyarrow.parquet as pq

    graded = pq.read_table(rewards).to_pylist()
    summary = {
        "harness": args.harness,
        "model": args.model,
        "families": families,
        "seed": args.seed,
        "train_tasks": len(split.train),
        "sessions": len(graded),
        "passed": sum(r["reward"] == 1.0 for r in graded),
        "sft_accepted": json.loads((run_dir / "sft" / "counts.json").read_text())["total"],
        **training,
        "held_out": evaluations,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "checkpoint": str(run_dir / "model"),
    }
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return summary


def evaluate(folder: Path, tasks: Path, model: str, args: argparse.Namespace) -> dict:
    """`polar-mitm rollout` of the held-out tasks with `model` sampling freely (no script) through the harness:
    pass@1 with its interval clustered by task, the share of sessions with a parsed tool call, unparsed calls."""
    import pyarrow.parquet as pq
    from bench_real_harness_learning import behaviour_figures, clustered_interval  # beside this file

    folder.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        engine, env = ["--model", model], {}
        # vLLM, the capstone's engine: ours decodes SmolLM2 at a few tokens a second on 2 cores.
        if args.eval_engine == "vllm":
            from polar_mitm.engines import keys as engine_keys
            from polar_mitm.vllm.server import resolve_vllm_model, vllm_running

            url = stack.enter_context(vllm_running(resolve_vllm_model(model), log=folder / "vllm.log"))
            # The rollout's gateway needs vLLM's key: in a file of mode 600, never on a command line.
            key_file = folder / "engine.key"
            key_file.touch(mode=0o600)
            key_file.write_text(engine_keys.key_for(url) or "")
            engine, env = ["--engine", url], {engine_keys.KEY_FILE_ENV: str(key_file)}
        polar_mitm(
            "rollout", str(tasks), "--harness", args.harness, *engine, "-g", str(args.eval_samples),
            "-c", str(args.concurrency), "--temperature", str(args.temperature), "--max-tokens", str(args.max_tokens),
            "--out", str(folder / "flows"), "--rewards", str(folder / "rewards.parquet"),
            "--work-dir", str(folder / "rollout"), "--log-format", "lines",
            log=folder / "rollout.log",
            env=env,
        )  # fmt: skip
    behaviour = behaviour_figures(folder)
    if behaviour["calls"] and behaviour["engine_errors"] == behaviour["calls"]:  # nothing was sampled at all
        raise SystemExit(
            f"warm start: every held-out call of {model} failed at the engine; see {folder}/flows"
        )
    per_task: dict[str, dict[str, int]] = {}
    for row in pq.read_table(folder / "rewards.parquet").to_pylist():
        counts = per_task.setdefault(row["task_id"], {"samples": 0, "passed": 0})
        counts["samples"] += 1
        counts["passed"] += row["reward"] == 1.0
    passed, attempts = (
        sum(c["passed"] for c in per_task.values()),
        sum(c["samples"] for c in per_task.values()),
    )
    return {
        "model": model,
        "pass@1": passed / attempts if attempts else 0.0,
        "ci95": list(clustered_interval(per_task)),
        "passed": passed,
        "attempts": attempts,
        "tasks": len(per_task),
        **behaviour,
    }


def train_sft(dataset_dir: Path, model_dir: Path, out: Path, args: argparse.Namespace) -> dict:
    """TRL's SFTTrainer on the tokenized export (labels as given: loss on the teacher's sampled tokens only)."""
    import torch
    from datasets import load_from_disk
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from polar_mitm.storage.tokenizer_files import save_tokenizer

    torch.manual_seed(args.seed)
    dataset = load_from_disk(str(dataset_dir))
    if len(dataset) == 0:
        raise SystemExit(f"warm start: no session passed, nothing to train on ({dataset_dir})")
    config = SFTConfig(
        output_dir=str(out.parent / "sft-trainer"),
        num_train_epochs=args.epochs,
        learning_rate=args.learning_rate,
        per_device_train_batch_size=args.batch_size,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,
        activation_checkpointing=False,
        disable_tqdm=True,
        assistant_only_loss=False,
        dataset_num_proc=None,
        max_length=None,  # a harness's prompt alone is longer than TRL's 1024: cut, every label would be masked
        seed=args.seed,
    )
    trainer = SFTTrainer(model=str(model_dir), args=config, train_dataset=dataset)
    result = trainer.train()
    trainer.save_model(str(out))
    save_tokenizer(AutoTokenizer.from_pretrained(str(model_dir)), out)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "sequences": len(dataset),
        "trained_tokens": int(sum(sum(1 for x in row if x != -100) for row in dataset["labels"])),
        "epochs": args.epochs,
        "steps": result.global_step,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/warm-start"))
    parser.add_argument("--harness", default="pi")
    parser.add_argument("--model", default="smollm2", help="the student (and the teacher's tokenizer)")
    parser.add_argument("--families", default=FILE_FAMILIES)
    parser.add_argument("--train-tasks", type=int, default=16, help="per family")
    parser.add_argument("--held-out-tasks", type=int, default=8, help="per family (never taught)")
    parser.add_argument("-g", "--group-size", type=int, default=1)
    parser.add_argument("-c", "--concurrency", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=2,
        help="held-out samples per task, before and after (0: no evaluation)",
    )
    parser.add_argument(
        "--eval-engine", default="vllm", choices=["vllm", "embedded"], help="the held-out evaluation's engine"
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="the held-out evaluation's sampling")
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="the held-out evaluation's completion budget"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    summary = teach(parse_args(argv))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
