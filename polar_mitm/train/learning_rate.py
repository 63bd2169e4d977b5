"""One default learning rate per kind of model, for `grpo` and `loop` when `--learning-rate` is not given.

The kinds differ by orders of magnitude, so one number for all is wrong for most: our `tiny` model is random and
learns the demo's choice at ~1e-3; SmolLM2-135M moved its held-out answers at 3e-5 in the capstone
(recipes/real-harness-learning.md); a multi-billion-parameter instruct model trained by GRPO wants ~1e-6 (Polar,
DeepSWE). A checkpoint's kind is what its `polar_model.json` says (ours and every training of ours carry it); any
other checkpoint is `pretrained`. The command prints which it chose and why, so the default is never silent.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_LEARNING_RATES = {"tiny": 5e-3, "smollm2": 3e-5, "pretrained": 1e-6}
LEARNING_RATE_HELP = (
    "AdamW learning rate (default: by model — tiny 5e-3, smollm2 3e-5, any other checkpoint 1e-6; printed)."
)


def model_kind(model_dir: str | Path) -> str:
    """`tiny` or `smollm2` for our models and the checkpoints trained from them, else `pretrained`."""
    marker = Path(model_dir) / "polar_model.json"
    try:
        kind = json.loads(marker.read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    return kind if kind in DEFAULT_LEARNING_RATES else "pretrained"


def default_learning_rate(model_dir: str | Path) -> tuple[float, str]:
    """The learning rate for a training of `model_dir`, and the line that says so."""
    kind = model_kind(model_dir)
    rate = DEFAULT_LEARNING_RATES[kind]
    what = "a pretrained checkpoint" if kind == "pretrained" else f"the {kind} model"
    return rate, f"learning rate {rate:g}, the default for {what} (--learning-rate sets it)"
