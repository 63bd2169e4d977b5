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

    .venv/bin/python benchmarks/bench_train_step.py --floor    # ~11 minutes on 2 cores (issue 45 §2)

`--floor` asks what a GRPO step costs over the model's own work. For the tiny model and SmolLM2-135M (`--model`)
at packed rows of 2k and 8k tokens (`--tokens`): GRPO groups of 4 sessions of tokens / 4 (a fifth prompt, the rest
sampled), one group a step, so every optimizer step is one packed row of exactly that many tokens; each path runs
in its own process (its own peak RSS), over the same groups in the same order:

- the floor: the model loaded as the trainer loads it (fp32, transformers' attention switched to the trainer's
  per-sequence `segment_attention`), its forward on the packed row as the trainer runs it (position ids restarting
  per sequence; TRL's fused LM head scoring the sampled tokens only, log-probs alone), the mean NLL of those
  tokens, backward, gradient clipping (`max_grad_norm`), the optimizer transformers builds from the same config
  (fused AdamW) and `zero_grad` — timed around exactly that;
- the GRPO step: `PolarGRPOTrainer.train()` on those groups (dapo, packed, `check_behaviour_logps` off, every row
  fresh), each step timed from the previous step's end to its own: the batch fetched and scored, the micro-batch
  packed, the loss's forward (log-probs and entropies) and backward, the optimizer, metrics and logs.

Activation checkpointing is the trainer's choice by memory (`--checkpointing auto`), which the floor then takes
(`on`/`off` force both). After `FLOOR_REPEATS` warm-up steps, the median of the timed steps gives tokens/s; peak
RSS is the process's (`ru_maxrss`, read before any profiled step), beside what the steps add over the RSS once
loaded. Targets: the step ≥ 70% of the floor's tokens/s, peak RSS ≤ 1.5× the floor's. `--profile` runs one more
step of each path under torch.profiler and prints the ops whose self CPU time grew most from floor to step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
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
            sequences.append(merged_sequence(f"{kind}{t}", g, ids, prompt, passed))
    return sequences


def merged_sequence(task: str, g: int, ids: list[int], prompt: int, passed: bool):
    """Session `g` of `task` as one merged sequence: `prompt` context tokens, then sampled ones (logprob -1)."""
    from polar_mitm.storage.merged import MergedSequence

    mask = [0] * prompt + [1] * (len(ids) - prompt)
    return MergedSequence(
        sequence_id=f"{task}-{g}",
        session_id=f"{task}-{g}",
        task_id=task,
        input_ids=ids,
        loss_mask=mask,
        logprobs=[-1.0 if m else 0.0 for m in mask],
        prompt_len=prompt,
        request_ids=[f"{task}-{g}-r0"],
        n_turns=1,
        builder="prefix_merging",
        weight_version_min="0",
        weight_version_max="0",
        reward=1.0 if passed else 0.0,
    )


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


# -- --floor: a full GRPO step beside a plain forward + backward of the same packed tokens --------------------------

FLOOR_MODELS = ("tiny", "smollm2")
FLOOR_TOKENS = (2048, 8192)
STEP_TARGET, MEMORY_TARGET = 0.70, 1.5  # issue 45 §2: step tokens/s ≥ 70% of the floor's, peak RSS ≤ 1.5×
# (warm-up steps, timed steps) per case: on 2 CPU cores a SmolLM2 step of 8k tokens takes over a minute
FLOOR_REPEATS = {
    ("tiny", 2048): (2, 5),
    ("tiny", 8192): (1, 3),
    ("smollm2", 2048): (1, 3),
    ("smollm2", 8192): (1, 1),
}


def floor_sequences(tokens: int, groups: int, group_size: int, seed: int) -> list:
    """`groups` GRPO groups of `group_size` sessions of tokens / group_size tokens (a fifth prompt, the rest sampled;
    half pass), so each group packs into one row of exactly `tokens` tokens: one optimizer step."""
    rng, length = random.Random(seed), tokens // group_size
    return [
        merged_sequence(
            f"t{t}", g, [rng.randrange(1000, 30000) for _ in range(length)], length // 5, g % 2 == 0
        )
        for t in range(groups)
        for g in range(group_size)
    ]


def packed_groups(sequences: list, group_size: int) -> list[tuple]:
    """Each group end to end in one row, as the trainer packs a micro-batch: (input_ids [1, T], position_ids
    restarting per sequence, the scored positions [1, T-1] — the sampled tokens, each predicted from the one
    before)."""
    import torch

    rows = []
    for start in range(0, len(sequences), group_size):
        group = sequences[start : start + group_size]
        ids = torch.tensor([t for s in group for t in s.input_ids]).unsqueeze(0)
        positions = torch.cat([torch.arange(len(s.input_ids)) for s in group]).unsqueeze(0)
        loss = torch.tensor([m for s in group for m in s.loss_mask], dtype=torch.bool).unsqueeze(0)
        rows.append((ids, positions, loss[:, 1:]))
    return rows


def floor_config(out: Path, args: argparse.Namespace, checkpointing: str):
    """The one configuration both paths read: the trainer's defaults (fp32, transformers' attention, AdamW as
    transformers builds it, max_grad_norm), one group a step, packed; `checkpointing` on/off forces activation
    checkpointing, auto lets the trainer choose by memory."""
    from polar_mitm.train.grpo_config import PolarGRPOConfig

    return PolarGRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.group_size,
        gradient_accumulation_steps=1,
        num_train_epochs=1,
        learning_rate=1e-5,
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
        check_behaviour_logps=False,  # a one-off forward before the first step, not part of a step
        stale_correction="none",  # every step trains as on fresh rollouts (a stale one adds a no-grad forward)
        shuffle_dataset=False,
        batch_layout="packed",
        dataloader_pin_memory=False,
        activation_checkpointing=checkpointing == "on",
        memory_budget_gb=math.inf if checkpointing == "off" else None,
    )


def current_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def clock() -> tuple[float, float]:
    """Wall and CPU time (all the process's threads: steadier than wall time while other jobs share the cores)."""
    return time.perf_counter(), time.process_time()


def step_seconds(marks: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Each step's wall and CPU seconds, from the clock read at each step's end (and before the first)."""
    steps = list(zip(marks, marks[1:], strict=False))
    return {"seconds": [b[0] - a[0] for a, b in steps], "cpu_seconds": [b[1] - a[1] for a, b in steps]}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


class OpProfile:
    """Self CPU seconds per op between `start` and `stop` (torch.profiler), and `(outside ops)`: the wall time the
    ops do not account for (Python, waiting)."""

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self.started
        self.profiler.__exit__(None, None, None)
        ops = {e.key: e.self_cpu_time_total / 1e6 for e in self.profiler.key_averages()}
        return ops | {"(outside ops)": max(wall - sum(ops.values()), 0.0)}


def floor_child(model_dir: Path, rows: list[tuple], args: argparse.Namespace) -> dict:
    """The floor: the model loaded as the trainer loads it, its forward on the packed row as the trainer runs it
    (segment attention, TRL's fused head scoring the sampled tokens only, log-probs alone), the mean NLL of those
    tokens, backward, gradient clipping, the optimizer step and zero_grad."""
    import torch
    from transformers import Trainer
    from trl.trainer.utils import add_fused_lm_head, create_model_from_path

    from polar_mitm.train.packing import packed_logps, use_segment_attention
    from polar_mitm.train.scoring import score_labelled_positions_on_cpu

    config = floor_config(Path(tempfile.mkdtemp(prefix="bench-floor-")), args, args.checkpointing)
    score_labelled_positions_on_cpu()
    model = create_model_from_path(str(model_dir), **(config.model_init_kwargs or {}))
    use_segment_attention(model)
    add_fused_lm_head(model)
    if args.checkpointing == "on":
        model.gradient_checkpointing_enable(config.gradient_checkpointing_kwargs)
    model.train()
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(config, model)
    optimizer = optimizer_cls(model.parameters(), **optimizer_kwargs)

    def step(ids, positions, scored) -> None:
        logps = packed_logps(model, ids, positions, ids.size(1) - 1, scored)[0]
        (-logps.sum() / scored.sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    loaded, marks, timed = current_rss(), [clock()], args.warmup + args.repeats
    for ids, positions, scored in rows[:timed]:
        step(ids, positions, scored)
        marks.append(clock())
    result = {"loaded_rss": loaded, "peak_rss": peak_rss()} | step_seconds(marks)
    if args.profile:  # one more step, after the peak was read
        profile = OpProfile()
        profile.start()
        step(*rows[timed])
        result["ops"] = profile.stop()
    return result | describe(model, optimizer)


def describe(model, optimizer) -> dict:
    """What the comparison must hold equal between the paths."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    flags = {k: optimizer.defaults.get(k) for k in ("lr", "fused", "foreach") if k in optimizer.defaults}
    return {
        "dtype": str(next(model.parameters()).dtype),
        "attention": model.config._attn_implementation,
        "checkpointing": bool(model.is_activation_checkpointing),
        "optimizer": f"{type(optimizer).__name__} {flags}",
    }


def step_child(model_dir: Path, sequences: list, args: argparse.Namespace) -> dict:
    """A full GRPO step: `PolarGRPOTrainer.train()` over the groups, one group (one packed row) per optimizer step,
    each step timed from the previous step's end to its own (the batch fetched, scored, split, the loss's forward
    and backward, the optimizer, metrics and logs)."""
    from transformers import TrainerCallback

    from polar_mitm.train.data import build_training_data

    counting, _ = trainer_classes()
    marks: list[tuple[float, float]] = []
    state: dict[str, Any] = {}
    profile, timed = OpProfile(), args.warmup + args.repeats

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            state["loaded_rss"] = current_rss()
            marks.append(clock())

        def on_step_end(self, *_, **__):
            marks.append(clock())
            done = len(marks) - 1
            if done == timed:
                state["peak_rss"] = peak_rss()  # before any profiled step
                if args.profile:  # one more step, after the timed ones
                    profile.start()
            elif done == timed + 1 and args.profile:
                state["ops"] = profile.stop()

    out = Path(tempfile.mkdtemp(prefix="bench-grpo-step-"))
    config = floor_config(out, args, args.checkpointing)
    trainer = counting(str(model_dir), args=config, train_data=build_training_data(sequences))
    trainer.add_callback(StepClock())
    trainer.train()
    result = {"loaded_rss": state["loaded_rss"], "peak_rss": state["peak_rss"]} | step_seconds(
        marks[: timed + 1]
    )
    result["tokens_computed"] = trainer.computed  # every step's packed row, the profiled one included
    if "ops" in state:
        result["ops"] = state["ops"]
    return result | describe(trainer.model, trainer.optimizer)


def run_child(path: str, model: str, tokens: int, args: argparse.Namespace, checkpointing: str) -> dict:
    """One path of one case in its own process (its own peak RSS); its last stdout line is the result."""
    warmup, repeats = case_repeats(model, tokens, args)
    command = [sys.executable, __file__, "--floor-child", path, "--model", model, "--tokens", str(tokens)]
    command += ["--warmup", str(warmup), "--repeats", str(repeats), "--threads", str(args.threads)]
    command += [
        "--checkpointing",
        checkpointing,
        "--group-size",
        str(args.group_size),
        "--seed",
        str(args.seed),
    ]
    done = subprocess.run(command + ["--profile"] * args.profile, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{path} {model} {tokens}: exit {done.returncode}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def case_repeats(model: str, tokens: int, args: argparse.Namespace) -> tuple[int, int]:
    default = FLOOR_REPEATS.get((model, tokens), (1, 3))
    return (
        default[0] if args.warmup is None else args.warmup,
        default[1] if args.repeats is None else args.repeats,
    )


def floor_child_main(args: argparse.Namespace) -> None:
    from polar_mitm.engine.model_zoo import resolve_model

    groups = args.warmup + args.repeats + int(args.profile)
    sequences = floor_sequences(args.tokens[0], groups, args.group_size, args.seed)
    model_dir = resolve_model(args.model[0])
    if args.floor_child == "floor":
        result = floor_child(model_dir, packed_groups(sequences, args.group_size), args)
    else:
        result = step_child(model_dir, sequences, args)
    print(json.dumps(result))


def gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def floor_main(args: argparse.Namespace) -> None:
    """Every case: the GRPO step first (with `auto` the trainer chooses activation checkpointing), then the floor
    with the same choice; a line per case as it ends, then the table against the targets."""
    results = []
    for model in args.model:
        for tokens in args.tokens:
            step = run_child("step", model, tokens, args, args.checkpointing)
            floor = run_child("floor", model, tokens, args, "on" if step["checkpointing"] else "off")
            case = {"model": model, "tokens": tokens, "floor": floor, "step": step}
            case["repeats"] = case_repeats(model, tokens, args)
            for path in ("floor", "step"):
                for key, rate in (("seconds", "tokens_per_s"), ("cpu_seconds", "tokens_per_cpu_s")):
                    case[path][rate] = tokens / statistics.median(case[path][key][case["repeats"][0] :])
            results.append(case)
            same = {k: (floor[k], step[k]) for k in ("dtype", "attention", "checkpointing", "optimizer")}
            print(f"{model} {tokens}: {json.dumps(same)}")
            for path in ("floor", "step"):
                walls, cpus = (
                    " ".join(f"{x:.2f}" for x in case[path][k]) for k in ("seconds", "cpu_seconds")
                )
                print(f"  {path} seconds per step: wall {walls}; CPU {cpus}")
            expected = tokens * (sum(case["repeats"]) + int(args.profile))
            if step["tokens_computed"] != expected:
                print(f"  the GRPO step computed {step['tokens_computed']} tokens, not {expected}")
    print_floor_table(results)
    if args.profile:
        for case in results:
            print_op_difference(case)


def print_floor_table(results: list[dict]) -> None:
    """One line per case: tokens/s (wall, then per CPU second) and peak RSS, the step's against the floor's."""
    print(
        f"\n{'model':<8} {'tokens':>6} {'w+t':>4} | {'floor tok/s':>11} {'step tok/s':>10} {'step/floor':>10} | "
        f"{'tok/CPU s':>9} {'step':>6} {'step/floor':>10} | {'floor peak':>10} {'step peak':>10} {'step/floor':>10} "
        f"| {'floor +':>8} {'step +':>8}"
    )
    for case in results:
        floor, step = case["floor"], case["step"]
        speed = step["tokens_per_s"] / floor["tokens_per_s"]
        cpu_speed = step["tokens_per_cpu_s"] / floor["tokens_per_cpu_s"]
        memory = step["peak_rss"] / floor["peak_rss"]
        print(
            f"{case['model']:<8} {case['tokens']:>6} {'+'.join(map(str, case['repeats'])):>4} | "
            f"{floor['tokens_per_s']:>11.1f} {step['tokens_per_s']:>10.1f} "
            f"{speed:>6.2f} {'ok' if speed >= STEP_TARGET else 'LOW':>3} | "
            f"{floor['tokens_per_cpu_s']:>9.1f} {step['tokens_per_cpu_s']:>6.1f} "
            f"{cpu_speed:>6.2f} {'ok' if cpu_speed >= STEP_TARGET else 'LOW':>3} | "
            f"{gb(floor['peak_rss']):>10} {gb(step['peak_rss']):>10} "
            f"{memory:>5.2f}× {'ok' if memory <= MEMORY_TARGET else 'HIGH':>4} | "
            f"{gb(floor['peak_rss'] - floor['loaded_rss']):>8} {gb(step['peak_rss'] - step['loaded_rss']):>8}"
        )
    print(
        f"targets: step tokens/s ≥ {STEP_TARGET:.0%} of the floor's, peak RSS ≤ {MEMORY_TARGET}× the floor's. "
        "w+t: warm-up + timed steps (medians of the timed); tok/CPU s: per CPU second of the process (steadier "
        "than wall time while other jobs share the cores); floor + / step +: peak RSS over the RSS once loaded "
        "(what the steps add)"
    )


def print_op_difference(case: dict, top: int = 12) -> None:
    """Where the step's extra time goes: the ops whose self CPU time grew most from the floor's step to the GRPO
    step's (one profiled step each, same tokens)."""
    floor, step = case["floor"]["ops"], case["step"]["ops"]
    total = sum(step.values()) - sum(floor.values())
    print(
        f"\nprofile {case['model']} {case['tokens']}: profiled step {sum(floor.values()):.2f} s floor, "
        f"{sum(step.values()):.2f} s GRPO ({total:+.2f} s); largest differences (self CPU s):"
    )
    names = sorted(set(floor) | set(step), key=lambda k: step.get(k, 0) - floor.get(k, 0), reverse=True)
    for name in names[:top]:
        print(f"  {name[:60]:<60} {floor.get(name, 0):>7.3f} → {step.get(name, 0):>7.3f}")


def add_floor_options(parser: argparse.ArgumentParser) -> None:
    floor = parser.add_argument_group(
        "--floor: a GRPO step beside a plain forward + backward of the same tokens"
    )
    floor.add_argument(
        "--floor", action="store_true", help="run the floor comparison instead of the length mix"
    )
    floor.add_argument("--model", nargs="+", default=list(FLOOR_MODELS), choices=FLOOR_MODELS)
    floor.add_argument("--tokens", nargs="+", type=int, default=list(FLOOR_TOKENS), help="packed row lengths")
    floor.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps (default: per case, FLOOR_REPEATS)"
    )
    floor.add_argument("--repeats", type=int, default=None, help="timed steps (default: per case)")
    floor.add_argument(
        "--checkpointing",
        choices=("auto", "on", "off"),
        default="auto",
        help="activation checkpointing: auto = the trainer's choice by memory, which the floor then takes",
    )
    floor.add_argument(
        "--profile",
        action="store_true",
        help="one more step of each path under torch.profiler; print the ops' difference",
    )
    floor.add_argument("--floor-child", choices=("floor", "step"), default=None, help=argparse.SUPPRESS)


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
        default=None,
        help="torch threads (default 1: steady figures while other jobs share the cores; --floor: every core)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep each run's metrics.jsonl here")
    parser.add_argument(
        "--token-normaliser",
        choices=("step", "run"),
        default="step",
        help="dapo's normaliser: each step's loss tokens, or the run's constant (the spread is printed)",
    )
    add_floor_options(parser)
    args = parser.parse_args(argv)
    if args.floor_child:
        import torch

        torch.set_num_threads(args.threads)
        floor_child_main(args)
        return
    if args.floor:
        args.threads = args.threads or os.cpu_count() or 1
        floor_main(args)
        return
    args.threads = args.threads or 1
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
