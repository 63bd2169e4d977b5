"""Loading a checkpoint's tokenizer with and without its added tokens in tokenizer_config.json (storage/tokenizer_files.py).

transformers 5 saves a tokenizers-backed tokenizer without `added_tokens_decoder` and then parses the whole
tokenizer.json in Python on every load to find them. Every engine, gateway, merge and training loads one. For each
built-in model this copies its tokenizer files twice — as transformers saves them, and as polar-mitm keeps them —
loads each `--loads` times, alternating, and prints the median load of each and the ratio. Both must give the same
tokenizer (tests/storage/test_tokenizer_files.py checks it token for token).

    .venv/bin/python benchmarks/bench_tokenizer_load.py [--models tiny,smollm2] [--loads 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from polar_mitm.engine.model_zoo import resolve_model
from polar_mitm.storage.tokenizer_files import ADDED_TOKENS_KEY, CONFIG_FILE, keep_added_tokens_in_config

TOKENIZER_FILES = ("tokenizer.json", CONFIG_FILE, "chat_template.jinja")


def tokenizer_copy(model_dir: Path, out: Path, *, keep_added_tokens: bool) -> Path:
    out.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    config = json.loads((out / CONFIG_FILE).read_text())
    config.pop(ADDED_TOKENS_KEY, None)  # as transformers 5 saves it
    (out / CONFIG_FILE).write_text(json.dumps(config))
    if keep_added_tokens:
        keep_added_tokens_in_config(out)
    return out


def seconds_to_load(folder: Path) -> float:
    start = time.perf_counter()
    AutoTokenizer.from_pretrained(str(folder))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--loads", type=int, default=5)
    args = parser.parse_args()
    print(f"{'model':10} {'tokenizer.json':>15} {'as saved':>10} {'kept':>10} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.models.split(","):
            model_dir = resolve_model(spec)
            plain = tokenizer_copy(model_dir, Path(tmp) / spec / "as-saved", keep_added_tokens=False)
            kept = tokenizer_copy(model_dir, Path(tmp) / spec / "kept", keep_added_tokens=True)
            seconds_to_load(plain), seconds_to_load(kept)  # warm: the imports and the page cache
            times: dict[Path, list[float]] = {plain: [], kept: []}
            for _ in range(args.loads):
                for folder in times:
                    times[folder].append(seconds_to_load(folder))
            saved_s, kept_s = (statistics.median(times[f]) for f in (plain, kept))
            size_mb = (model_dir / "tokenizer.json").stat().st_size / 1e6
            print(f"{spec:10} {size_mb:12.1f} MB {saved_s:9.3f}s {kept_s:9.3f}s {saved_s / kept_s:6.2f}×")


if __name__ == "__main__":
    main()
