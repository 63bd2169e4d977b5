"""The parts of one GRPO run that `polar-mitm grpo` and the loop build alike: the training rows of merged sequences,
the LoRA config, the `PolarGRPOConfig` of a run.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

if typing.TYPE_CHECKING:
    from polar_mitm.train.grpo_config import PolarGRPOConfig


def training_data(sequences: list, fields: dict[str, Any]):
    """The training rows of merged sequences under a config's data options (as `polar-mitm grpo` builds them)."""
    from polar_mitm.train.data import build_training_data

    return build_training_data(
        sequences,
        estimator=fields.get("advantage_estimator", "mean_std"),
        scale_rewards=fields.get("scale_rewards", "group"),
        max_length=fields.get("max_length"),
        group_size=fields.get("group_size"),
        keep_truncated_sampling=fields.get("keep_truncated_sampling", False),
    )


def lora_config(r: int, alpha: int, target_modules: str):
    """PEFT's LoraConfig from the LoRA options (`all-linear` or a comma list of module names)."""
    from peft import LoraConfig

    targets = target_modules if target_modules == "all-linear" else target_modules.split(",")
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, task_type="CAUSAL_LM")


def grpo_config(
    fields: dict[str, Any], *, output_dir: Path, save_steps: int, report_to: str
) -> PolarGRPOConfig:
    """The `PolarGRPOConfig` of a `polar-mitm grpo` call: its config options, and the few it spells its own way."""
    from polar_mitm.train.grpo_config import PolarGRPOConfig

    return PolarGRPOConfig(
        output_dir=str(output_dir),
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[] if report_to == "none" else report_to.split(","),
        **fields,
    )
