"""`polar-mitm loop` and `rollout` set `LoopConfig` / `RolloutConfig` fields: each option's default (and, for the
loop, its help) is the field's, and a field added to `LoopConfig` with a help text must be an option. Fixed value
sets are declared once (`BuilderName`)."""

from __future__ import annotations

import dataclasses

import typer
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.reconstruct.builders import BuilderName
from polar_mitm.reconstruct.merge import BUILDERS
from polar_mitm.rollout.cli import ROLLOUT_FIELDS
from polar_mitm.rollout.loop import LoopConfig
from polar_mitm.rollout.runner import RolloutConfig

# `loop` options spelt otherwise than their LoopConfig field.
LOOP_RENAMED = {"engine": "engine_url", "batch_size": "per_device_batch_size", "ray": "ray_address"}
LOOP_NOT_OPTIONS = {"loss_type", "seed", "final_rollout"}  # set from Python only (no help on purpose)


def params_of(command: str) -> dict:
    click_command = typer.main.get_command(app).commands[command]
    return {param.name: param for param in click_command.params}


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
