"""Does the demo learn, reliably? README's RL loop (`polar-mitm demo`, step 2) for several seeds.

For each seed (the tiny model's initial weights and the trainer's seed): the demo's loop — 3 tasks × 4 sessions of
the SDK agent through the gateway, prefix-merged, GRPO, weights pushed — for N training iterations, then one rollout
of the trained policy. Prints the mean session reward of every rollout, the model's probability of choosing each
task's passing candidate before and after training (the scripted choice is the model's probability of each whole
answer), and the wall time; exits 1 if a seed's last rollout is below the target.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_demo_learning.py [--seeds 0 1 2] [--iterations 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from polar_mitm.demo import DEMO_LEARNING_RATE, demo_loop_config, right_choice_probabilities
from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.loop.loop import Loop
from polar_mitm.loop.progress import quiet_libraries
from polar_mitm.loop.run_state import in_run_dir


def run_seed(seed: int, iterations: int, learning_rate: float, root: Path) -> dict:
    """One demo loop; its rewards per rollout, choice probabilities before/after, and seconds."""
    run_dir = root / f"seed-{seed}"
    started = time.monotonic()
    results = Loop(
        demo_loop_config(
            model="tiny", iterations=iterations, run_dir=run_dir, learning_rate=learning_rate, seed=seed
        )
    ).run()
    seconds = time.monotonic() - started
    flows = run_dir / "iter-0" / "flows"
    before = right_choice_probabilities(resolve_model("tiny", seed=seed), flows)
    # The last training's weights: an iteration whose groups were all flat trains nothing (its train/ holds only
    # skipped.json) and keeps the weights before it, which its train marker names.
    last = json.loads((run_dir / f"iter-{iterations - 1}" / "state.json").read_text())
    # Stored relative to the run directory since runs can be moved (loop/run_state.py's stored_path).
    after = right_choice_probabilities(
        in_run_dir(last["stages"]["train"]["model_dir"], run_dir, run_dir), flows
    )
    return {
        "seed": seed,
        "rewards": [r.reward_mean for r in results],
        "before": before,
        "after": after,
        "seconds": seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--iterations", type=int, default=3, help="training iterations (then one more rollout)"
    )
    parser.add_argument("--learning-rate", type=float, default=DEMO_LEARNING_RATE)
    parser.add_argument("--target", type=float, default=0.85, help="last rollout's mean reward to reach")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-demo-learning"))
    args = parser.parse_args()
    quiet_libraries()
    console = Console()
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.iterations, args.learning_rate, args.out))
        console.print(
            f"seed {seed}: rewards {' → '.join(f'{r:.2f}' for r in rows[-1]['rewards'])} "
            f"({rows[-1]['seconds']:.0f}s)"
        )
    table = Table(
        title=f"demo loop: {args.iterations} trainings + a rollout of the trained policy, "
        f"lr {args.learning_rate:g}"
    )
    table.add_column("seed", justify="right")
    table.add_column("mean reward per rollout")
    table.add_column("P(passing choice) before → after, per task")
    table.add_column("loop seconds", justify="right")
    for row in rows:
        choices = ", ".join(
            f"{task} {row['before'][task]:.2f}→{row['after'][task]:.2f}" for task in row["before"]
        )
        table.add_row(
            str(row["seed"]), " → ".join(f"{r:.2f}" for r in row["rewards"]), choices, f"{row['seconds']:.0f}"
        )
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    reached = [row["rewards"][-1] >= args.target for row in rows]
    console.print(f"last rollout ≥ {args.target}: {sum(reached)}/{len(rows)} seeds")
    return 0 if all(reached) else 1


if __name__ == "__main__":
    sys.exit(main())
