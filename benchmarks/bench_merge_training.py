"""GRPO training time on the same rollouts merged two ways: per_request vs prefix_merging sequences.

    .venv/bin/python benchmarks/bench_merge_training.py                # ~6 min on 2 CPU cores
    .venv/bin/python benchmarks/bench_merge_training.py --sessions 16 --turns 8 --workdir runs/bench-mt

The Polar paper trains on the turns of a session merged into one sequence instead of one sequence per request:
1185 → 218 trainer updates and a 5.39× faster training run. This measures the same on our stack, on CPU:

1. record: the tiny engine playing a scripted agent (`polar-mitm serve --script`) behind the real gateway
   (mitmdump + addon, reverse mode), driven by the OpenAI-chat SDK agent. Each session is a `--turns`-call agent
   loop: `--turns - 1` shell tool calls, each answered by a simulated test run of `--tool-lines` lines, then a final
   answer — so every prompt is the previous prompt + the assistant turn + a tool result. Sessions come in GRPO
   groups of `--group-size` per task_id; a session's reward is the pass rate of its simulated test runs (it
   varies inside a group, so the advantages are not zero).
2. merge the records twice with `polar_mitm.reconstruct.merge.merge` (invariants checked): per_request and
   prefix_merging.
3. train the tiny model one epoch over each: `PolarGRPOTrainer` with identical hyper-parameters (`polar-mitm grpo`'s
   defaults, `--batch-size` sequences per update, max_steps = the number of length-bucketed batches), each run in
   its own process; the wall time is that of `trainer.train()`.

Reported per builder: sequences, trainer updates (optimizer steps), tokens processed (padding excluded), sampled
(loss) tokens, the padding fraction of the batches, training wall time and CPU time, tokens/s, seconds per update
and peak RSS; then the per_request / prefix_merging ratios.

Reading the figures: on CPU, TRL scores the LM head at every position (skipping the prompt needs its Triton kernel),
and the tiny model's 152k-token vocabulary makes that head nearly all the work, so training time follows the tokens
processed: expect a speed-up near the `tokens` ratio, plus the per-update overhead saved. Other load on the machine
slows wall time (the load average is printed after each run) far more than CPU time; `--workdir` keeps each run's
per-step tokens/s (`run-*/metrics.jsonl`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BUILDERS = ("per_request", "prefix_merging")
POLAR_PAPER = {"per_request updates": 1185, "prefix_merging updates": 218, "speed-up": 5.39}
API_KEY = "sk-bench-merge-training"
FINAL_ANSWER = "All checks ran; the fix is in place and the remaining failures are reported above."


# -- recording: the scripted tiny engine behind the gateway, driven by the SDK agent ----------------------------------


def agent_script(turns: int) -> list:
    """The engine's scripted policy: `turns - 1` shell calls (turn k tests module k), then a final answer."""
    calls = [
        {
            "text": f"Step {k + 1}: run the tests of module {k}.",
            "tool_call": {"name": "shell", "arguments": {"command": f"pytest -q tests/test_module_{k}.py"}},
        }
        for k in range(turns - 1)
    ]
    return [*calls, FINAL_ANSWER]


class SimulatedTestRun:
    """A session's shell tool: each call prints a pytest-like log; the session's pass rate is its reward."""

    def __init__(self, rng: random.Random, lines: tuple[int, int]) -> None:
        self.rng, self.lines = rng, lines
        self.fail_rate = rng.uniform(0.05, 0.6)  # how good this rollout's fix is
        self.passed = self.total = 0

    def __call__(self, args: dict) -> str:
        module = str(args.get("command", "")).rsplit("/", 1)[-1]
        n = self.rng.randint(*self.lines)
        outcomes = [self.rng.random() >= self.fail_rate for _ in range(n)]
        self.passed += sum(outcomes)
        self.total += n
        log = [
            f"{module}::test_case_{i:02d} {'PASSED' if ok else 'FAILED'} [{100 * (i + 1) // n:3d}%]"
            for i, ok in enumerate(outcomes)
        ]
        return "\n".join([*log, f"==== {sum(outcomes)} passed, {n - sum(outcomes)} failed ===="])

    @property
    def reward(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass
class Rollouts:
    """What `record` produced: the gateway's records, the rewards file, and how long it took."""

    flows: Path
    rewards: Path
    sessions: int
    model_calls: int
    seconds: float


def record(
    workdir: Path,
    *,
    sessions: int,
    turns: int,
    group_size: int,
    tool_lines: tuple[int, int],
    concurrency: int,
    seed: int,
) -> Rollouts:
    """Run `sessions` agent sessions through the real gateway; write a rewards JSONL next to the records."""
    from polar_mitm.agent.sdk_agent import DRIVERS, base_url_for
    from polar_mitm.engines import processes as engine_processes
    from polar_mitm.gateway import processes as gateway_processes
    from polar_mitm.processes import children

    started = time.perf_counter()
    script = workdir / "script.json"
    script.write_text(json.dumps(agent_script(turns)))
    flows = workdir / "flows"
    engine, engine_url = engine_processes.start_engine(
        "tiny", log=workdir / "engine.log", extra_args=["--script", str(script)]
    )
    try:
        gateway = gateway_processes.start_gateway(
            engine_url, flows, confdir=workdir / "gateway-conf", log=workdir / "gateway.log"
        )
        try:

            def run_session(index: int) -> dict:
                session_id, task_id = f"sess-{index:04d}", f"task-{index // group_size:03d}"
                tests = SimulatedTestRun(random.Random(seed * 1_000_003 + index), tool_lines)
                prompt = f"The tests of package {task_id} fail. Find the bug, fix it and run the test suite."
                base_url = base_url_for("openai_chat", gateway.reverse_url, f"/t/{task_id}/s/{session_id}")
                result = DRIVERS["openai_chat"](
                    prompt, api_key=API_KEY, base_url=base_url, stream=False, max_turns=turns, run_tool=tests
                )
                if result.calls != turns:
                    raise RuntimeError(f"{session_id}: {result.calls} model calls, expected {turns}")
                return {"session_id": session_id, "task_id": task_id, "reward": round(tests.reward, 4)}

            # A few sessions at once, as a rollout runs them: the records arrive interleaved, and the client and
            # gateway work of one session overlaps the engine's work for another.
            with ThreadPoolExecutor(concurrency) as pool:
                rewards = list(pool.map(run_session, range(sessions)))
        finally:
            gateway.stop()
    finally:
        children.stop(engine)
    rewards_file = workdir / "rewards.jsonl"
    rewards_file.write_text("".join(json.dumps(r) + "\n" for r in rewards))
    return Rollouts(
        flows=flows,
        rewards=rewards_file,
        sessions=sessions,
        model_calls=sessions * turns,
        seconds=time.perf_counter() - started,
    )


# -- training (each run in its own process) ---------------------------------------------------------------------------


def train_one_epoch(merged: str, output_dir: str, batch_size: int, seed: int) -> dict:
    """One epoch of GRPO over the merged shards under `merged`; wall time of `trainer.train()` and batch figures."""
    import torch
    import transformers
    from transformers import PrinterCallback

    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.train.batching import length_buckets, padding_fraction
    from polar_mitm.train.data import build_training_data, load_sequences
    from polar_mitm.train.grpo_config import PolarGRPOConfig
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # Known and harmless here (CPU run, TRL's own calls); they would bury the figures.
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    data = build_training_data(load_sequences(merged))
    lengths = data.lengths()
    # The trainer's own batches (LengthBucketSampler): their order is shuffled, their contents are these.
    batches = length_buckets(lengths, batch_size, shuffle=False)
    config = PolarGRPOConfig(
        output_dir=output_dir,
        max_steps=len(batches),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1,
        report_to=[],
        disable_tqdm=True,
        seed=seed,
    )
    trainer = PolarGRPOTrainer(str(resolve_model("tiny")), args=config, train_data=data)
    trainer.remove_callback(PrinterCallback)  # the table is the output; metrics.jsonl keeps the per-step logs
    started, cpu_started = time.perf_counter(), cpu_seconds()
    trainer.train()
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu_started
    return {
        "sequences": len(data.rows),
        "updates": trainer.state.global_step,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "tokens": sum(lengths[i] for batch in batches for i in batch),
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "sampled_tokens": data.stats.sampled_tokens,
        "longest": max(lengths),
        "padding": padding_fraction(lengths, batches),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def cpu_seconds() -> float:
    """CPU time of this process, all threads, user + system: unlike wall time, barely moved by other load."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def in_child(function, *args):
    """Run `function(*args)` in a fresh process: each run's memory and threads are its own."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


# -- main -------------------------------------------------------------------------------------------------------------


COLUMNS = (  # (header, width, format, whether the per_request / prefix_merging ratio means something)
    ("sequences", 10, "{:,}", True),
    ("updates", 9, "{:,}", True),
    ("tokens", 10, "{:,}", True),
    ("loss tok", 10, "{:,}", True),
    ("longest", 9, "{:,}", False),
    ("padding", 9, "{:.1%}", False),
    ("train s", 9, "{:.1f}", True),
    ("CPU s", 8, "{:.1f}", True),
    ("tokens/s", 10, "{:,.0f}", False),
    ("s/update", 10, "{:.2f}", False),
    ("peak RSS MB", 13, "{:,.0f}", False),
)


def table_values(run: dict) -> list[float]:
    return [
        run["sequences"],
        run["updates"],
        run["tokens"],
        run["sampled_tokens"],
        run["longest"],
        run["padding"],
        run["seconds"],
        run["cpu_seconds"],
        run["tokens"] / run["seconds"],
        run["seconds"] / max(1, run["updates"]),
        run["peak_rss_mb"],
    ]


def print_table(runs: dict[str, dict]) -> None:
    """One row per builder, then the per_request / prefix_merging ratios, then the paper's figures."""
    print(f"{'':<18}" + "".join(f"{header:>{width}}" for header, width, _, _ in COLUMNS))
    for name, run in runs.items():
        print(
            f"{name:<18}"
            + "".join(
                f"{fmt.format(value):>{width}}"
                for (_, width, fmt, _), value in zip(COLUMNS, table_values(run), strict=True)
            )
        )
    per_request, merged = (table_values(runs[b]) for b in BUILDERS)
    print(
        f"{'ratio (per_req/pm)':<18}"
        + "".join(
            f"{f'{a / b:.2f}×' if wanted else '':>{width}}"
            for (_, width, _, wanted), a, b in zip(COLUMNS, per_request, merged, strict=True)
        )
    )
    slow, fast = runs["per_request"], runs["prefix_merging"]
    print()
    print(
        f"speed-up of prefix_merging over per_request (training wall time): {slow['seconds'] / fast['seconds']:.2f}× "
        f"({slow['updates']} → {fast['updates']} updates, {slow['tokens']:,} → {fast['tokens']:,} tokens, "
        f"the same {fast['sampled_tokens']:,} sampled tokens trained on); "
        f"{slow['cpu_seconds'] / fast['cpu_seconds']:.2f}× in CPU time"
    )
    paper = POLAR_PAPER
    print(
        f"Polar paper: {paper['per_request updates']} → {paper['prefix_merging updates']} updates "
        f"({paper['per_request updates'] / paper['prefix_merging updates']:.2f}×), {paper['speed-up']}× faster"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8, help="agent sessions to record")
    parser.add_argument(
        "--turns", type=int, default=6, help="model calls per session (≥ 2: tool calls + answer)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=4, help="sequences per trainer update (both builders)"
    )
    parser.add_argument("--group-size", type=int, default=4, help="sessions per task_id (GRPO group)")
    parser.add_argument(
        "--tool-lines",
        type=int,
        nargs=2,
        default=(1, 4),
        metavar=("MIN", "MAX"),
        help="lines per simulated test run (each ~20 tokens)",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="sessions run at once while recording")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep records, merged shards and runs here (default: a temporary folder, removed after)",
    )
    args = parser.parse_args(argv)
    if args.turns < 2 or args.group_size < 2 or args.sessions < args.group_size or args.batch_size < 2:
        parser.error("need --turns ≥ 2, --group-size ≥ 2, --sessions ≥ --group-size and --batch-size ≥ 2")

    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.reconstruct.merge import merge

    started = time.perf_counter()
    model_dir = resolve_model("tiny")  # built once into the cache, before any process needs it
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-merge-training-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        rollouts = record(
            workdir,
            sessions=args.sessions,
            turns=args.turns,
            group_size=args.group_size,
            tool_lines=tuple(args.tool_lines),
            concurrency=args.concurrency,
            seed=args.seed,
        )
        print(
            f"recorded {rollouts.sessions} sessions × {args.turns} turns ({rollouts.model_calls} model calls; "
            f"task_id groups of {args.group_size}) through the gateway in {rollouts.seconds:.1f} s",
            flush=True,
        )
        runs: dict[str, dict] = {}
        for builder in BUILDERS:
            merged = workdir / f"merged-{builder}"
            summary = merge(
                [str(rollouts.flows)],
                str(merged),
                builder=builder,
                rewards=str(rollouts.rewards),
                tokenizer=str(model_dir),
                drop_unrewarded=True,
            )
            print(
                f"merge {builder}: {summary.trainable_records} records → {summary.sequences} sequences, "
                f"{summary.total_tokens:,} tokens, breaks {summary.breaks or 'none'}",
                flush=True,
            )
            runs[builder] = in_child(
                train_one_epoch, str(merged), str(workdir / f"run-{builder}"), args.batch_size, args.seed
            )
            run = runs[builder]
            # Other work on the machine slows the runs unequally: the load average says how busy it was.
            print(
                f"train {builder}: {run['updates']} updates in {run['seconds']:.1f} s "
                f"(load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
            if run["tokens_seen"] != run["tokens"]:
                raise RuntimeError(
                    f"{builder}: the trainer saw {run['tokens_seen']} tokens, the batches hold "
                    f"{run['tokens']}"
                )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(f"GRPO, tiny model, one epoch, batch size {args.batch_size}, {os.cpu_count()} CPU threads")
    print_table(runs)
    print(f"total benchmark time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
