"""The trainer's LM head scoring every completion position (before) vs only the tokens the loss reads (after).

    .venv/bin/python benchmarks/bench_lm_head.py                     # tiny model, the recorded harness sessions
    .venv/bin/python benchmarks/bench_lm_head.py --model smollm2     # the demo's model (49k vocabulary)

Data: the six recorded harness sessions (sample_flows/harness/*.parquet), prefix-merged as `polar-mitm merge`
does, each cut to `--max-length` tokens and made a GRPO group of two (rewards 1 and 0). One epoch of
`PolarGRPOTrainer` per path, same hyper-parameters, in one process, packed and padded layouts:

- `all positions`: the head as TRL runs it on CPU — every position of the completion window (on a packed row, the
  whole row) projected through the vocabulary;
- `loss positions`: train/scoring.py — labels only on the sampled tokens, and only labelled positions projected.

Printed per path: training wall and CPU seconds, the scored fraction, the speed-up (CPU seconds: steadier than wall
time on shared cores), and the largest |Δ| of the logged losses and the largest relative Δ of the logged gradient
norms between the two paths (what must not change; tests/train/test_scoring.py compares the gradients themselves).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
PATHS = ("all positions", "loss positions")


def harness_sequences(model_dir: Path, max_length: int, work: Path) -> list:
    """The recorded harness sessions, merged and cut; two copies each (a group), rewards 1 and 0."""
    from dataclasses import replace

    from polar_mitm.reconstruct.merge import merge
    from polar_mitm.train.data import load_sequences, truncate

    flows = sorted(str(p) for p in (ROOT / "sample_flows" / "harness").glob("*.parquet"))
    merge(flows, str(work / "merged"), tokenizer=str(model_dir))
    sequences = []
    for seq in load_sequences(work / "merged"):
        cut = truncate(seq, max_length)
        if cut is None:
            continue
        for g, reward in enumerate((1.0, 0.0)):
            sequences.append(
                replace(
                    cut,
                    sequence_id=f"{cut.sequence_id}-{g}",
                    session_id=f"{cut.session_id}-{g}",
                    task_id=cut.session_id,
                    reward=reward,
                )
            )
    return sequences


@contextmanager
def every_position():
    """The head as before: TRL's CPU rule (project the whole window), and no loss-position labels."""
    import trl.trainer.utils as trl_utils

    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

    compact = trl_utils._use_triton
    original = getattr(compact, "original", compact)
    scoring_only = PolarGRPOTrainer._scoring_only

    @contextmanager
    def score_all(self, positions):
        yield

    trl_utils._use_triton, PolarGRPOTrainer._scoring_only = original, score_all
    try:
        yield
    finally:
        trl_utils._use_triton, PolarGRPOTrainer._scoring_only = compact, scoring_only


def run_path(path: str, layout: str, sequences: list, model_dir: Path, out: Path, args) -> dict:

    from polar_mitm.train.data import build_training_data
    from polar_mitm.train.grpo_config import PolarGRPOConfig
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

    config = PolarGRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=1,
        learning_rate=1e-4,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        check_behaviour_logps=False,
        batch_layout=layout,
        dataloader_pin_memory=False,
        temperature=1.0,
    )
    trainer = PolarGRPOTrainer(str(model_dir), args=config, train_data=build_training_data(sequences))
    tokens = sum(len(s.input_ids) for s in sequences)
    sampled = sum(sum(s.loss_mask) for s in sequences)
    with every_position() if path == "all positions" else contextmanager(lambda: (yield))():
        started, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    return {
        "path": path,
        "layout": layout,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "losses": [s["loss"] for s in steps],
        "grad_norms": [s["grad_norm"] for s in steps],
        "scored": sampled / tokens if path == "loss positions" else 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny | smollm2 | PATH")
    parser.add_argument("--max-length", type=int, default=4096, help="cut each session to this many tokens")
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()

    from polar_mitm.engine.model_zoo import resolve_model

    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        sequences = harness_sequences(model_dir, args.max_length, Path(tmp))
        tokens = sum(len(s.input_ids) for s in sequences)
        print(f"{len(sequences)} sequences, {tokens} tokens, {args.model} model")
        results = []
        for layout in ("packed", "padded"):
            for path in PATHS:
                results.append(
                    run_path(path, layout, sequences, model_dir, Path(tmp) / f"{layout}-{path[:3]}", args)
                )
    print(
        f"\n{'layout':<7} {'path':<15} {'scored':>6} {'wall s':>7} {'cpu s':>7} {'×cpu':>6} {'max|Δloss|':>10} "
        f"{'max rel Δ grad norm':>19}"
    )
    for r in results:
        base = next(b for b in results if b["layout"] == r["layout"] and b["path"] == "all positions")
        d_loss = max(abs(a - b) for a, b in zip(r["losses"], base["losses"], strict=True))
        d_grad = max(abs(a - b) / abs(b) for a, b in zip(r["grad_norms"], base["grad_norms"], strict=True))
        print(
            f"{r['layout']:<7} {r['path']:<15} {r['scored']:>6.1%} {r['seconds']:>7.1f} {r['cpu_seconds']:>7.1f} "
            f"{base['cpu_seconds'] / r['cpu_seconds']:>5.2f}× {d_loss:>10.2e} {d_grad:>19.2e}"
        )


if __name__ == "__main__":
    main()
