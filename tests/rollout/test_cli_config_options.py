"""`polar-mitm loop` and `rollout` set `LoopConfig` / `RolloutConfig` fields: each option's default (and, for the
loop, its help) is the field's, and a field added to `LoopConfig` with a help text must be an option. The loop's
trainer options are `polar-mitm grpo`'s, generated from the same PolarGRPOConfig (but for the fields the loop sets
itself), and land in `LoopConfig.grpo`. Fixed value sets are declared once (`BuilderName`)."""

from __future__ import annotations

import dataclasses

import typer
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.loop.cli import LOOP_OPTION_FIELDS, loop_config
from polar_mitm.loop.config import LOOP_SETS, LOOP_TRAINER_DEFAULTS, LoopConfig
from polar_mitm.reconstruct.builders import BuilderName
from polar_mitm.reconstruct.merge import BUILDERS
from polar_mitm.rollout.cli import ROLLOUT_FIELDS
from polar_mitm.rollout.runner import RolloutConfig

LOOP_RENAMED = LOOP_OPTION_FIELDS  # `loop` options spelt otherwise than their LoopConfig field
LOOP_NOT_OPTIONS = {"grpo", "seed", "final_rollout"}  # set from Python only (no help on purpose)


def params_of(command: str) -> dict:
    """The options a command declares itself (not the generated config options)."""
    click_command = typer.main.get_command(app).commands[command]
    return {param.name: param for param in click_command.params}


def all_params_of(command: str, argv: list[str]) -> dict:
    """Every option of a command, the generated config options included."""
    click_command = typer.main.get_command(app).commands[command]
    return {
        param.name: param for param in click_command.get_params(click_command.make_context(command, argv))
    }


def test_every_loop_option_is_a_loop_config_field_with_its_default_and_help():
    params = params_of("loop")
    fields = {f.name: f for f in dataclasses.fields(LoopConfig)}
    for name, param in params.items():
        field = fields[LOOP_RENAMED.get(name, name)]
        assert param.help == field.metadata["help"], name
        if field.default is not dataclasses.MISSING:
            assert param.default == field.default, name
    options = {LOOP_RENAMED.get(name, name) for name in params}
    assert {f.name for f in dataclasses.fields(LoopConfig) if f.metadata.get("help")} == options
    assert set(fields) - options == LOOP_NOT_OPTIONS


def test_every_grpo_option_but_those_the_loop_sets_is_a_loop_option_with_the_same_flag_and_help():
    grpo = all_params_of("grpo", ["--data", "d"])
    loop = all_params_of("loop", ["tasks.jsonl"])
    trainer_options = set(grpo) - set(params_of("grpo"))  # the generated ones
    assert {
        "torch_dtype",
        "attn_implementation",
        "activation_checkpointing",
        "beta",
        "delta",
    } <= trainer_options
    for name in trainer_options - set(LOOP_SETS):
        assert name in loop, name
        assert (loop[name].opts, loop[name].help) == (grpo[name].opts, grpo[name].help), name
        assert loop[name].default == LOOP_TRAINER_DEFAULTS.get(name, grpo[name].default), name
    assert not (set(LOOP_SETS) & (set(loop) - set(params_of("loop"))))  # the loop's own spelling, or none


def test_loop_trainer_options_reach_the_loop_config():
    argv = ["tasks.jsonl", "--torch-dtype", "bf16", "--beta", "0.04", "--lr-scheduler", "cosine", "-n", "3"]
    command = typer.main.get_command(app).commands["loop"]
    parsed = command.make_context("loop", [*argv, "--no-session-weighting"]).params
    generated = {param.name for param in command.config_params}
    cfg = loop_config(
        {k: v for k, v in parsed.items() if k not in generated}, {k: parsed[k] for k in generated}
    )
    assert cfg.iterations == 3 and cfg.grpo["torch_dtype"] == "bf16" and cfg.grpo["beta"] == 0.04
    assert cfg.grpo["lr_scheduler_type"] == "cosine" and cfg.grpo["session_weighting"] is False
    assert (
        cfg.grpo["delta"] == 2.0 and cfg.grpo["loss_type"] == "dapo"
    )  # untouched options keep grpo's defaults


def test_rollout_options_default_to_the_rollout_config():
    params = params_of("rollout")
    for name in ROLLOUT_FIELDS:
        assert params[name].default == getattr(RolloutConfig(), name), name


def test_builder_names_are_the_merge_builders_and_every_command_offers_them():
    assert set(BuilderName) == set(BUILDERS)
    for argv in (["merge", "--builder", "nonsense"], ["loop", "tasks.jsonl", "--builder", "nonsense"]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2 and all(b.value in result.output for b in BuilderName), argv
        assert params_of(argv[0])["builder"].default == BuilderName.prefix_merging
