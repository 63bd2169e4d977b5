"""`polar-mitm grpo`'s options come from `PolarGRPOConfig`: every field Polar adds is an option with the field's help,
a field declared later shows up by itself, and every option the command had keeps its name, default and meaning."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.core import TyperCommand
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.config_options import option_values
from polar_mitm.train.config_options import GRPO_OPTIONS, GrpoCommand, grpo_options, polar_fields
from polar_mitm.train.grpo_config import PolarGRPOConfig
from polar_mitm.train.run import grpo_config

COMMAND_ONLY = {
    "data",
    "output_dir",
    "model",
    "lora",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "save_steps",
    "report_to",
    "overwrite",
    "help",
    "config",  # --config FILE and --show-config (config_file.py): every config-generated command has them
    "show_config",
}


def grpo_click_command():
    return typer.main.get_command(app).commands["grpo"]


def parse(argv: list[str]) -> dict:
    """The grpo command's parsed values, by name (config fields and command-only options alike)."""
    return dict(grpo_click_command().make_context("grpo", argv).params)


def options_by_name() -> dict:
    command = grpo_click_command()
    return {param.name: param for param in command.get_params(command.make_context("grpo", ["--data", "d"]))}


def config_of(params: dict) -> PolarGRPOConfig:
    """What the command builds from its parsed values (as `GrpoCommand.invoke` hands them to `grpo_command`)."""
    fields = {name: value for name, value in params.items() if name not in COMMAND_ONLY}
    return grpo_config(
        fields,
        output_dir=params["output_dir"],
        save_steps=params["save_steps"],
        report_to=params["report_to"],
    )


def test_every_field_polar_adds_is_a_grpo_option_with_the_fields_help_and_default():
    options = options_by_name()
    added = polar_fields(PolarGRPOConfig)
    assert {"group_size", "stale_correction", "push_to_engine", "check_behaviour_logps"} <= {
        f.name for f in added
    }
    for field in added:
        assert field.name in options, field.name
        assert options[field.name].help == field.metadata["help"], field.name
        assert options[field.name].default == field.default, field.name


def test_a_field_declared_later_appears_in_the_command_with_its_help():
    @dataclasses.dataclass
    class LaterConfig(PolarGRPOConfig):
        reward_clip: float | None = dataclasses.field(
            default=None, metadata={"help": "Clip rewards to [-c, c] before the group statistics."}
        )
        shuffle_groups: bool = dataclasses.field(default=True, metadata={"help": "Shuffle whole groups."})

    params = {param.name: param for param in grpo_options(LaterConfig)}
    assert params["reward_clip"].opts == ["--reward-clip"]
    assert params["reward_clip"].help == "Clip rewards to [-c, c] before the group statistics."
    assert params["shuffle_groups"].opts == ["--shuffle-groups"]
    assert params["shuffle_groups"].secondary_opts == ["--no-shuffle-groups"]
    seen: dict = {}
    command = TyperCommand(
        "later", params=list(params.values()), callback=lambda **values: seen.update(values)
    )
    command.main(["--reward-clip", "2.5", "--no-shuffle-groups"], standalone_mode=False)
    assert seen["reward_clip"] == 2.5 and seen["shuffle_groups"] is False
    assert seen["stale_correction"] == "token_truncate" and seen["num_train_epochs"] == 1.0


def test_a_field_without_help_is_refused():
    @dataclasses.dataclass
    class Undocumented(PolarGRPOConfig):
        knob: int = 3

    with pytest.raises(ValueError, match="Undocumented.knob has no metadata"):
        grpo_options(Undocumented)


# Every option `polar-mitm grpo --help` listed before its options were generated, with a value other than its default.
EVERY_OPTION = [
    "--data",
    "d1",
    "--data",
    "d2",
    "-o",
    "out",
    "-m",
    "smollm2",
    "--lora",
    "--lora-r",
    "4",
    "--lora-alpha",
    "8",
    "--lora-target-modules",
    "q_proj,v_proj",
    "--no-save-merged",
    "--max-steps",
    "3",
    "--epochs",
    "2.5",
    "--max-length",
    "40",
    "--learning-rate",
    "0.01",
    "--lr-scheduler",
    "constant",
    "--warmup-steps",
    "2",
    "--per-device-batch-size",
    "3",
    "--gradient-accumulation-steps",
    "2",
    "--num-generations",
    "3",
    "--strict-group-size",
    "--temperature",
    "0.7",
    "--keep-truncated-sampling",
    "--no-session-weighting",
    "--behaviour-logp-tolerance",
    "0.5",
    "--drop-mismatched-rows",
    "--loss-type",
    "grpo",
    "--epsilon",
    "0.1",
    "--epsilon-high",
    "0.28",
    "--beta",
    "0.04",
    "--advantage",
    "leave_one_out",
    "--scale-rewards",
    "batch",
    "--importance-sampling-level",
    "sequence",
    "--num-iterations",
    "2",
    "--stale-correction",
    "sequence_mask",
    "--stale-is-clip-max",
    "3.0",
    "--policy-weight-version",
    "5",
    "--push-to-engine",
    "http://engine:1",
    "--push-every-steps",
    "2",
    "--save-steps",
    "10",
    "--report-to",
    "none",
    "--activation-checkpointing",
    "--seed",
    "7",
]


def test_every_option_the_command_had_still_parses_into_the_same_config_field():
    params = parse(EVERY_OPTION)
    assert params["data"] == [Path("d1"), Path("d2")] and params["model"] == "smollm2"
    assert (params["lora"], params["lora_r"], params["lora_alpha"]) == (True, 4, 8)
    assert params["lora_target_modules"] == "q_proj,v_proj"
    config = config_of(params)
    expected = {
        "output_dir": "out",
        "save_merged": False,
        "max_steps": 3,
        "num_train_epochs": 2.5,
        "max_length": 40,
        "learning_rate": 0.01,
        "lr_scheduler_type": "constant",
        "warmup_steps": 2,
        "per_device_train_batch_size": 3,
        "gradient_accumulation_steps": 2,
        "group_size": 3,
        "strict_group_size": True,
        "temperature": 0.7,
        "keep_truncated_sampling": True,
        "session_weighting": False,
        "behaviour_logp_tolerance": 0.5,
        "drop_mismatched_rows": True,
        "loss_type": "grpo",
        "epsilon": 0.1,
        "epsilon_high": 0.28,
        "beta": 0.04,
        "advantage_estimator": "leave_one_out",
        "scale_rewards": "batch",
        "importance_sampling_level": "sequence",
        "num_iterations": 2,
        "stale_correction": "sequence_mask",
        "stale_is_clip_max": 3.0,
        "policy_weight_version": "5",
        "push_to_engine": "http://engine:1",
        "push_every_steps": 2,
        "save_strategy": "steps",
        "save_steps": 10,
        "report_to": [],
        "activation_checkpointing": True,
        "seed": 7,
    }
    assert {name: getattr(config, name) for name in expected} == expected
    assert parse(["--data", "d", "--bf16"])["bf16"] is True  # (a bf16 config needs a GPU or use_cpu)
    assert parse(["--data", "d", "--report-to", "tensorboard,wandb"])["report_to"] == "tensorboard,wandb"


def test_the_default_config_is_the_one_the_command_built_before():
    params = parse(["--data", "d"])
    assert params["output_dir"] == Path("runs/grpo") and params["model"] == "tiny" and params["lora"] is False
    # One change since: no --learning-rate is the model kind's rate (train/learning_rate.py), 1e-6 for a checkpoint.
    assert params.pop("learning_rate") is None
    params["learning_rate"] = 1e-6
    assert (params["lora_r"], params["lora_alpha"], params["lora_target_modules"]) == (16, 32, "all-linear")
    # The command's hand-written constructor call with its defaults, as it was before the options were generated.
    before = PolarGRPOConfig(
        output_dir="runs/grpo",
        max_steps=-1,
        num_train_epochs=1.0,
        max_length=None,
        learning_rate=1e-6,
        lr_scheduler_type="linear",
        warmup_steps=0,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        group_size=None,
        strict_group_size=False,
        temperature=1.0,
        keep_truncated_sampling=False,
        session_weighting=True,
        behaviour_logp_tolerance=0.1,
        drop_mismatched_rows=False,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=None,
        beta=0.0,
        advantage_estimator="mean_std",
        scale_rewards="group",
        importance_sampling_level="token",
        num_iterations=1,
        stale_correction="token_truncate",
        stale_is_clip_max=2.0,
        policy_weight_version=None,
        push_to_engine=None,
        push_every_steps=0,
        save_merged=True,
        save_strategy="no",
        save_steps=500,
        report_to=["tensorboard"],
        bf16=False,
        activation_checkpointing=False,
        seed=0,
    )
    assert config_of(params).to_dict() == before.to_dict()


def test_grpo_command_gets_the_config_options_apart_from_its_own():
    seen: dict = {}

    def command(ctx: typer.Context, data: Annotated[list[Path], typer.Option("--data")]) -> None:
        seen.update(own={"data": data}, config=option_values(ctx, GRPO_OPTIONS))

    single = typer.Typer(add_completion=False)
    single.command("grpo", cls=GrpoCommand)(command)
    result = CliRunner().invoke(
        single, ["--data", "d", "--advantage", "leave_one_out", "--no-session-weighting"]
    )
    assert result.exit_code == 0, result.output
    assert seen["own"] == {"data": [Path("d")]}
    assert (
        seen["config"]["advantage_estimator"] == "leave_one_out"
        and seen["config"]["session_weighting"] is False
    )
    assert set(seen["config"]) == {name for name in options_by_name()} - COMMAND_ONLY


def test_listing_the_commands_does_not_import_trl():
    code = (
        "import sys, typer\nfrom polar_mitm.cli import app\ntyper.main.get_command(app)\n"
        "assert 'trl' not in sys.modules, 'building the app imported TRL'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
