"""One GRPO iteration on a realistic length mix: today's batches vs whole groups + trimmed vs whole groups + packed.

    .venv/bin/python benchmarks/bench_train_step.py            # ~7 CPU minutes (harness lengths ÷ 8)
    .venv/bin/python benchmarks/bench_train_step.py --full     # harness sessions of 10–30k tokens (hours on CPU)

The data is one dataset of GRPO groups (`--group-size` sessions per task, failures longer than passes, as agents'
are): `--sdk-tasks` short SDK tasks — sessions of 250–1000 tokens, around the recorded SDK sessions'
(sample_flows/records) — and `--harness-tasks` tasks whose sessions run 10–30k tokens like the recorded harness
sessions (sample_flows/harness: Claude Code 13k, Qwen Code 17k), scaled by `--scale` (default 1/8 so the run
finishes in minutes; `--full` is 1). Random token ids; one epoch of `PolarGRPOTrainer` on the tiny model with the
same hyper-parameters for each path, in one process:

- `today`: the batches before issue 24 — all rows sorted by length and cut into generation batches of
  `--per-device-batch-size × --accumulation` rows (groups split across steps; the last batch filled with
  placeholder copies that are computed too), split into micro-batches by TRL (random rows, the generation batch's
  full width);
- `grouped+trimmed`: whole groups per step (`batching.plan_batches`), micro-batches of similar lengths, each padded
  to its own longest row (`batch_layout=padded`);
- `grouped+packed`: the same steps, each micro-batch packed into one row (`batch_layout=packed`, the CPU default).

Reported per path: optimizer steps, useful tokens (tokens of real rows in the forward/backward passes), tokens
computed, padding fraction (1 - useful / computed, as counted from the micro-batches the loss ran on), training
wall time, useful tokens/s and the speed-up over today, and the same per CPU second (the process's CPU time: steadier
than wall time while other jobs share the cores). Targets (issue 24): padding ≤ 5% and ≥ 2× today's
tokens/s. `--flat-groups N` adds N groups whose sessions all pass: dynamic sampling leaves them out of the grouped
paths (today trains them), which shortens the iteration without changing tokens/s. The grouped paths also print
each step's loss normaliser and the spread of a token's weight between steps (`--token-normaliser step|run`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PATHS = ("today", "grouped+trimmed", "grouped+packed")
SDK_LENGTHS = (250, 1000)  # the recorded SDK sessions are 256–264 tokens; real tasks run a few turns more
HARNESS_LENGTHS = (10_000, 30_000)


def make_sequences(args: argparse.Namespace) -> list:
    """The length mix: SDK and harness groups, passes shorter than failures (×1.5–3), random token ids."""
    from polar_mitm.storage.merged import MergedSequence

    rng = random.Random(args.seed)
    kinds = ["sdk"] * args.sdk_tasks + ["harness"] * args.harness_tasks + ["flat"] * args.flat_groups
    sequences = []
    for t, kind in enumerate(kinds):
        low, high = HARNESS_LENGTHS if kind == "harness" else SDK_LENGTHS
        scale = args.scale if kind == "harness" else args.sdk_scale
        for g in range(args.group_size):
            passed = kind == "flat" or g % 2 == 0
            base = rng.uniform(low, high / 3) * scale
            length = max(16, int(base * (1.0 if passed else rng.uniform(1.5, 3.0))))
            prompt = max(8, length // 5)
            ids = [rng.randrange(1000, 30000) for _ in range(length)]
            mask = [0] * prompt + [1] * (length - prompt)
            sequences.append(
                MergedSequence(
                    sequence_id=f"{kind}{t}-{g}",
                    session_id=f"{kind}{t}-{g}",
                    task_id=f"{kind}{t}",
                    input_ids=ids,
                    loss_mask=mask,
                    logprobs=[-1.0 if m else 0.0 for m in mask],
                    prompt_len=prompt,
                    request_ids=[f"{kind}{t}-{g}-r0"],
                    n_turns=1,
                    builder="prefix_merging",
                    weight_version_min="0",
                    weight_version_max="0",
                    reward=1.0 if passed else 0.0,
                )
            )
    return sequences


def trainer_classes():
    """The trainer counting the tokens its loss computes, and the same trainer with today's batches."""
    import torch

    from polar_mitm.train.batching import BatchPlan, LengthBucketSampler, MicroBatchPlan
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

    class CountingTrainer(PolarGRPOTrainer):
        useful = computed = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            placeholder = inputs["placeholder"]
            width = inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1)
            if "position_ids" in inputs:  # one packed row: all real, or a filler
                useful = 0 if bool(placeholder.all()) else width
            else:
                lengths = inputs["prompt_ids"].size(1) + inputs["completion_mask"].sum(-1)
                useful = int(lengths[~placeholder].sum())
            self.useful += useful
            self.computed += inputs["prompt_ids"].size(0) * width
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class TodayTrainer(CountingTrainer):
        """Batches as before issue 24: length buckets over all rows, TRL's shuffled equal splits at full width."""

        def _get_train_sampler(self, dataset=None):
            return LengthBucketSampler(
                self.train_data.lengths(),
                batch_size=self.args.generation_batch_size,
                repeat_count=self.num_iterations * self.args.steps_per_generation,
                shuffle=bool(self.shuffle_dataset),
                seed=self.args.seed,
            )

        def batch_plan(self) -> BatchPlan:
            return BatchPlan(chunks=[], advantage={})

        def _log_batch_plan(self) -> None:
            pass

        def _plan_generation(self, inputs, mode):
            order = torch.randperm(len(inputs)).tolist()  # TRL's shuffle_sequence_dict
            size = len(inputs) // self.args.steps_per_generation
            micro = [order[k : k + size] for k in range(0, len(inputs), size)]
            lengths = [len(r["input_ids"]) for r in inputs]
            return list(range(len(inputs))), MicroBatchPlan(micro=micro, packed=False, lengths=lengths)

        def _micro_batch(self, batch, rows, prompt_lens, packed) -> dict[str, Any]:
            # TRL's split_tensor_dict: rows selected, every column kept (the generation batch's width).
            index = torch.tensor(rows, device=batch["prompt_ids"].device)
            return {
                k: (v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                for k, v in batch.items()
                if isinstance(v, torch.Tensor)
            }

        def _weigh_for_micro_batches(self, advantages, loss_mask, plan, session_weight, mode):
            return advantages, None  # TRL's normalisers as they were

    return CountingTrainer, TodayTrainer


def run_path(path: str, sequences: list, model_dir: Path, out: Path, args: argparse.Namespace) -> dict:
    from polar_mitm.train.data import build_training_data
    from polar_mitm.train.grpo_config import PolarGRPOConfig

    counting, today = trainer_classes()
    config = PolarGRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.accumulation,
        num_train_epochs=1,
        learning_rate=1e-5,
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
        check_behaviour_logps=False,  # the same one-off forward for every path: not part of the step
        batch_layout="packed" if path == "grouped+packed" else "padded",
        dataloader_pin_memory=False,
        token_normaliser=args.token_normaliser,
    )
    trainer = (today if path == "today" else counting)(
        str(model_dir), args=config, train_data=build_training_data(sequences)
    )
    started, cpu_started = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    steps = [
        json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
    ]
    return {
        "path": path,
        "steps": len(steps),
        "useful": trainer.useful,
        "computed": trainer.computed,
        "padding": 1 - trainer.useful / trainer.computed,
        "seconds": seconds,
        "tokens_per_s": trainer.useful / seconds,
        "cpu_seconds": cpu_seconds,
        "tokens_per_cpu_s": trainer.useful / cpu_seconds,
        "logged_padding": [round(s.get("padding_fraction", float("nan")), 4) for s in steps],
        "normalisers": [s["batch/loss_normaliser"] for s in steps if "batch/loss_normaliser" in s],
    }


def print_table(results: list[dict]) -> None:
    """One line per path; speed-ups are useful tokens per second (wall, then CPU) over today's."""
    base = next((r for r in results if r["path"] == "today"), None)

    def ratio(r: dict, key: str) -> str:
        return f"{r[key] / base[key]:.2f}×" if base else "-"

    print(
        f"\n{'path':<16} {'steps':>5} {'useful':>7} {'computed':>8} {'padding':>7} {'wall s':>7} {'tok/s':>6} "
        f"{'×today':>6} {'cpu s':>7} {'tok/cpu s':>9} {'×today':>6}"
    )
    for r in results:
        print(
            f"{r['path']:<16} {r['steps']:>5} {r['useful']:>7} {r['computed']:>8} {r['padding']:>7.1%} "
            f"{r['seconds']:>7.1f} {r['tokens_per_s']:>6.1f} {ratio(r, 'tokens_per_s'):>6} "
            f"{r['cpu_seconds']:>7.1f} {r['tokens_per_cpu_s']:>9.1f} {ratio(r, 'tokens_per_cpu_s'):>6}"
        )
    logged = {r["path"]: r["logged_padding"] for r in results if r["path"] != "today"}
    print(f"the trainer's own padding_fraction metric, per step: {json.dumps(logged)}")
    for r in results:
        if r["normalisers"]:  # a token's weight in its step's loss is 1 / the step's normaliser
            spread = max(r["normalisers"]) / min(r["normalisers"])
            print(
                f"loss normaliser per step ({r['path']}): {r['normalisers']}, per-token weight spread {spread:.2f}×"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdk-tasks", type=int, default=2, help="groups of short SDK sessions")
    parser.add_argument("--harness-tasks", type=int, default=1, help="groups of long harness sessions")
    parser.add_argument(
        "--flat-groups", type=int, default=0, help="groups whose sessions all pass (advantage 0)"
    )
    parser.add_argument("--group-size", type=int, default=4, help="sessions per task (GRPO group)")
    parser.add_argument(
        "--scale", type=float, default=1 / 8, help="harness session length factor (1 = 10–30k)"
    )
    parser.add_argument("--sdk-scale", type=float, default=1.0, help="SDK session length factor")
    parser.add_argument(
        "--full", action="store_true", help="real sizes: --scale 1, 8 SDK and 4 harness tasks"
    )
    parser.add_argument("--per-device-batch-size", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=4, help="gradient accumulation steps")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: steady figures while other jobs share the cores)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep each run's metrics.jsonl here")
    parser.add_argument(
        "--token-normaliser",
        choices=("step", "run"),
        default="step",
        help="dapo's normaliser: each step's loss tokens, or the run's constant (the spread is printed)",
    )
    args = parser.parse_args(argv)
    if args.full:
        args.scale, args.sdk_tasks, args.harness_tasks = 1.0, 8, 4

    import torch

    from polar_mitm.engine.model_zoo import resolve_model

    torch.set_num_threads(args.threads)
    model_dir = resolve_model("tiny")
    sequences = make_sequences(args)
    lengths = sorted(len(s.input_ids) for s in sequences)
    print(
        f"{len(sequences)} sequences in {len(sequences) // args.group_size} groups, {sum(lengths)} tokens "
        f"(shortest {lengths[0]}, median {lengths[len(lengths) // 2]}, longest {lengths[-1]}); "
        f"{args.per_device_batch_size} rows per micro-batch, {args.accumulation} micro-batches per step"
    )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-train-step-"))
    results = [run_path(p, sequences, model_dir, workdir / p.replace("+", "-"), args) for p in args.paths]
    print_table(results)
    print(f"load average after the runs: {os.getloadavg()[0]:.2f} (other jobs slow wall time, CPU time less)")


if __name__ == "__main__":
    main()
