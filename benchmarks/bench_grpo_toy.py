"""Toy-task learning curve: GRPO on CPU with the tiny model, through the whole loop (in-process engine sampling →
merged sequences with behaviour logprobs and rewards → PolarGRPOTrainer → checkpoint → engine reload).

Reward = fraction of sampled tokens in a target half of the vocabulary (see polar_mitm/train/toy.py); chance ≈ 0.5.

    .venv/bin/python benchmarks/bench_grpo_toy.py --iterations 8
    .venv/bin/python benchmarks/bench_grpo_toy.py --iterations 8 --plot runs/toy-curve.png
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=8, help="sample → train rounds")
    parser.add_argument("--steps-per-iteration", type=int, default=2, help="optimizer steps per round")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--temperature", type=float, default=0.05, help="sampling = trainer temperature")
    parser.add_argument("--prompts", type=int, default=4, help="tasks (GRPO groups) per round")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per task")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--plot", type=Path, default=None, help="also write the curve as a PNG")
    args = parser.parse_args()

    import torch
    import transformers

    from polar_mitm.engine.model_zoo import resolve_model
    from polar_mitm.train.toy import run_toy_grpo

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    print(
        f"toy GRPO: {args.prompts} tasks × {args.group_size} rollouts × {args.max_new_tokens} tokens, "
        f"T={args.temperature}, lr={args.learning_rate}, {args.steps_per_iteration} steps/round, "
        f"loss={args.loss_type}, seed={args.seed}"
    )
    print(f"{'iter':>4}  {'weights':>7}  {'mean reward':>11}  {'elapsed s':>9}")

    def report(iteration: int, reward: float, version: str) -> None:
        print(
            f"{iteration:>4}  {version:>7}  {reward:>11.3f}  {time.perf_counter() - start:>9.1f}", flush=True
        )

    with tempfile.TemporaryDirectory(prefix="polar-toy-") as work:
        run = run_toy_grpo(
            resolve_model("tiny"),
            work,
            iterations=args.iterations,
            steps_per_iteration=args.steps_per_iteration,
            learning_rate=args.learning_rate,
            n_prompts=args.prompts,
            group_size=args.group_size,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            loss_type=args.loss_type,
            seed=args.seed,
            on_iteration=report,
        )
    print(
        f"reward {run.rewards[0]:.3f} → {run.rewards[-1]:.3f} in {args.iterations} rounds, {run.seconds:.0f} s"
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(len(run.rewards)), run.rewards, marker="o")
        ax.axhline(run.rewards[0], color="grey", linestyle=":", label="start")
        ax.set(
            xlabel="iteration (sample → train → reload)",
            ylabel="mean reward",
            ylim=(0, 1.05),
            title="GRPO toy task, tiny model on CPU",
        )
        ax.grid(alpha=0.3)
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"plot → {args.plot}")


if __name__ == "__main__":
    main()
