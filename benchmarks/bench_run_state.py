"""What carrying one optimizer across `polar-mitm loop` iterations costs: each training saves AdamW's moments and the
LR scheduler to `RUN/trainer-state` at its end and loads them at its start (train/continuation.py), and the KL
reference is reloaded from the initial model. Measured against what an iteration's training pays anyway (building
the trainer, which loads the model, and writing the final checkpoint).

    .venv/bin/python benchmarks/bench_run_state.py                     # tiny (4.9M parameters) and a 145M model
    .venv/bin/python benchmarks/bench_run_state.py --sizes tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.train.scored_rows


def build_model(size: str, root: Path) -> Path:
    """`tiny`, or the tiny model's architecture and vocabulary widened to ~145M parameters (random weights)."""
    from polar_mitm.engine.model_zoo import resolve_model

    tiny = resolve_model("tiny")
    if size == "tiny":
        return tiny
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny)
    config.update({"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 4, "head_dim": 64})
    config.update({"num_attention_heads": 12, "num_key_value_heads": 4})
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1] * config.num_hidden_layers
    out = root / "wide"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "polar_model.json"):
        if (tiny / name).exists():
            shutil.copy2(tiny / name, out / name)
    return out


def make_trainer(model_dir: Path, sequences, out: Path, state_dir: Path | None, reference: Path | None):
    from polar_mitm.train.data import build_training_data
    from polar_mitm.train.grpo_config import PolarGRPOConfig
    from polar_mitm.train.grpo_trainer import PolarGRPOTrainer

    config = PolarGRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        disable_tqdm=True,
        learning_rate=1e-4,
        beta=0.04,
        run_state_dir=str(state_dir) if state_dir else None,
        reference_model=str(reference) if reference else None,
    )
    return PolarGRPOTrainer(str(model_dir), args=config, train_data=build_training_data(sequences))


def one_training(
    model_dir: Path, sequences, out: Path, state_dir: Path | None, reference: Path | None
) -> dict[str, float]:
    """Seconds of: building the trainer, its one step (loading a carried state included), the final save, saving
    the carried state; and, on a second trainer, loading that state alone (where `create_scheduler` does it)."""
    started = time.perf_counter()
    trainer = make_trainer(model_dir, sequences, out, state_dir, reference)
    built = time.perf_counter()
    trainer.train()
    trained = time.perf_counter()
    trainer.save_model(str(out))
    saved = time.perf_counter()
    state = trainer.save_run_state() if state_dir else None
    carried = time.perf_counter()
    load = 0.0
    if state_dir:
        reader = make_trainer(model_dir, sequences, out / "reader", state_dir, reference)
        reader.create_optimizer()
        load_started = time.perf_counter()
        reader.create_scheduler(num_training_steps=1)
        load = time.perf_counter() - load_started
    return {
        "build": built - started,
        "train_step": trained - built,
        "save_model": saved - trained,
        "save_state": carried - saved,
        "load_state": load,
        "state_mb": sum(p.stat().st_size for p in state.rglob("*") if p.is_file()) / 1e6 if state else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["tiny", "wide"], choices=["tiny", "wide"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import shutil

    import torch

    from polar_mitm.engine.generation import Engine
    from tests.train.scored_rows import task_groups

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for size in args.sizes:
            model_dir = build_model(size, root)
            params = sum(p.numel() for p in Engine(model_dir).model.parameters())
            sequences = task_groups(Engine(model_dir), 1)
            # A later iteration starts from other weights than the initial ones, its KL reference (beta 0.04).
            start = root / f"{size}-start"
            shutil.copytree(model_dir, start)
            for label, carry in (("fresh optimizer, reference = start (before)", False), ("carried", True)):
                state_dir, reference = (root / f"{size}-state", model_dir) if carry else (None, None)
                one_training(start, sequences, root / f"{size}-warm", state_dir, reference)  # warm-up; state
                runs = [
                    one_training(start, sequences, root / f"{size}-{i}", state_dir, reference)
                    for i in range(args.repeats)
                ]
                medians = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                print(
                    f"{size} ({params / 1e6:.1f}M params), {label}: "
                    + ", ".join(f"{k} {v:.3f}{'' if k == 'state_mb' else ' s'}" for k, v in medians.items())
                )


if __name__ == "__main__":
    main()
