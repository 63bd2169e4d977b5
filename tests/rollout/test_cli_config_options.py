"""`polar-mitm loop` and `rollout` options are generated from their configs (`LoopConfig`, `RolloutConfig`,
`RolloutCommandOptions`): every field carries its help, every field but the Python-only ones is an option, and
every option given on the command line lands in the field of its name. The loop's trainer options are `polar-mitm
grpo`'s, generated from the same PolarGRPOConfig (but for the fields the loop sets itself), and land in
`LoopConfig.grpo`. Settings the loop shares with rollout are rollout's declarations, and fixed value sets are declared
once (`BuilderName`)."""

from __future__ import annotations

import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from polar_mitm.cli import app
from polar_mitm.config_options import CONFIG_FIELDS, FIELD_DEFAULT, HELP, OPTION, FieldOption, option_fields
from polar_mitm.judges.options import JudgeOptions
from polar_mitm.loop.cli import LOOP_OPTIONS, given_or_resumed_config
from polar_mitm.loop.config import LOOP_SETS, LOOP_TRAINER_DEFAULTS, LoopConfig
from polar_mitm.reconstruct.builders import BuilderName
from polar_mitm.reconstruct.merge import BUILDERS
from polar_mitm.rollout.cli import (
    JUDGE_OPTIONS,
    ROLLOUT_OPTIONS,
    SESSION_OPTIONS,
    RolloutCommandOptions,
    rollout_settings,
)
from polar_mitm.rollout.runner import RolloutConfig
from polar_mitm.train.config_options import GRPO_OPTIONS

CONFIGS = (LoopConfig, RolloutConfig, RolloutCommandOptions, JudgeOptions)
PYTHON_ONLY = {  # set from Python (or by the command itself), never an option
    LoopConfig: {"grpo", "final_rollout"},
    RolloutConfig: {"workspace_root", "log_dir"},
    RolloutCommandOptions: set(),
    JudgeOptions: set(),
}
# (command, its option group, the config whose fields the group's options are)
GROUPS = [
    ("loop", LOOP_OPTIONS, LoopConfig),
    ("rollout", ROLLOUT_OPTIONS, RolloutCommandOptions),
    ("rollout", SESSION_OPTIONS, RolloutConfig),
    ("rollout", JUDGE_OPTIONS, JudgeOptions),
]


def click_command(name: str):
    return typer.main.get_command(app).commands[name]


def generated(name: str) -> dict[str, list]:
    """A command's generated options, by group (built as its first parse or --help builds them)."""
    command = click_command(name)
    command.get_params(command.make_context(name, ["tasks.jsonl"]))
    return command.generated


def all_params_of(command: str) -> dict:
    """Every option of a command, the generated config options included."""
    click = click_command(command)
    ctx = click.make_context(command, [], resilient_parsing=True)
    return {param.name: param for param in click.get_params(ctx)}


def parsed(name: str, argv: list[str]) -> typer.Context:
    """The command's context after parsing `argv`, its generated values where the command reads them."""
    command = click_command(name)
    ctx = command.make_context(name, argv)
    ctx.meta[CONFIG_FIELDS] = command.generated_values(ctx)
    return ctx


def option_default(field: dataclasses.Field) -> Any:
    """The default the field's option should have: its `option(default=...)`, else the field's (None: required)."""
    spelling = field.metadata.get(OPTION) or FieldOption()
    if spelling.default is not FIELD_DEFAULT:
        return spelling.default
    return None if field.default is dataclasses.MISSING else field.default


def other_value(param) -> tuple[list[str], Any]:
    """Command-line words that give `param` a value other than its default, and the value they parse to."""
    kind = param.type_descriptor.annotation
    flag = param.opts[0]
    if param.param_type_name == "argument":
        return ["elsewhere/tasks.jsonl"], Path("elsewhere/tasks.jsonl")
    if kind is bool:
        return ([param.secondary_opts[0]], False) if param.default else ([flag], True)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        value = next(member for member in kind if member != param.default)
    elif typing.get_origin(kind) is typing.Literal:
        value = next(choice for choice in typing.get_args(kind) if choice != param.default)
    elif kind is int:
        value = (param.default or 0) + 3
    elif kind is float:
        value = (param.default or 0.0) + 0.25
    elif kind is Path:
        value = Path(f"elsewhere/{param.name}")
    else:
        value = f"other-{param.name}"
    assert value != param.default, param.name
    return [flag, str(value.value if isinstance(value, enum.Enum) else value)], value


def every_option_changed(params: list, skip: set[str] = frozenset()) -> tuple[list[str], dict[str, Any]]:
    """argv giving each of `params` (but `skip`) another value than its default, and the values by field name."""
    argv, expected = [], {}
    for param in params:
        if param.name in skip:
            continue
        words, expected[param.name] = other_value(param)
        argv += words
    return argv, expected


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_of_the_configs_carries_its_help(config):
    for field in dataclasses.fields(config):
        assert field.metadata.get(HELP, "").strip(), f"{config.__name__}.{field.name} has no help"
    assert set(f.name for f in dataclasses.fields(config)) - set(option_fields(config)) == PYTHON_ONLY[config]


@pytest.mark.parametrize(("command", "group", "config"), GROUPS, ids=lambda x: getattr(x, "__name__", x))
def test_every_field_but_the_python_only_ones_is_an_option_with_its_help_and_default(command, group, config):
    params = {param.name: param for param in generated(command)[group]}
    fields = {f.name: f for f in dataclasses.fields(config)}
    assert list(params) == option_fields(config)
    for name, param in params.items():
        assert param.help == fields[name].metadata[HELP], name
        assert param.default == option_default(fields[name]), name


def test_every_loop_option_round_trips_into_the_loop_config():
    groups = generated("loop")
    own_argv, own = every_option_changed(groups[LOOP_OPTIONS], skip={"resume"})  # --resume reads RUN/run.json
    trainer_argv, trainer = every_option_changed(groups[GRPO_OPTIONS])
    cfg = given_or_resumed_config(parsed("loop", [*own_argv, *trainer_argv]))
    assert {name: getattr(cfg, name) for name in own} == own
    assert cfg.grpo == trainer
    assert parsed("loop", ["t.jsonl", "--resume"]).meta[CONFIG_FIELDS][LOOP_OPTIONS]["resume"] is True


def test_the_loop_options_left_out_keep_the_loop_config_defaults():
    cfg = given_or_resumed_config(parsed("loop", ["tasks.jsonl"]))
    defaults = LoopConfig(tasks=Path("tasks.jsonl"), run_dir=Path("runs/loop"))
    assert dataclasses.asdict(cfg) | {"grpo": {}} == dataclasses.asdict(defaults)
    assert cfg.grpo["lr_scheduler_type"] == "constant" and cfg.grpo["delta"] == 2.0  # the loop's, then grpo's


def test_every_rollout_option_round_trips_into_its_settings():
    groups = generated("rollout")
    own_argv, own = every_option_changed(groups[ROLLOUT_OPTIONS])
    session_argv, sessions = every_option_changed(groups[SESSION_OPTIONS])
    given, config = rollout_settings(parsed("rollout", [*own_argv, *session_argv]))
    assert dataclasses.asdict(given) == own
    assert {name: getattr(config, name) for name in sessions} == sessions
    assert (config.workspace_root, config.log_dir) == (
        own["work_dir"] / "workspaces",
        own["work_dir"] / "logs",
    )


def test_rollout_options_left_out_keep_the_rollout_config_defaults():
    given, config = rollout_settings(parsed("rollout", ["tasks.jsonl"]))
    assert given == RolloutCommandOptions(tasks=Path("tasks.jsonl"))
    assert (
        dataclasses.replace(config, workspace_root=RolloutConfig.workspace_root, log_dir=None)
        == RolloutConfig()
    )


def test_settings_the_loop_shares_with_rollout_are_rollouts_declarations():
    loop = {param.name: param for param in generated("loop")[LOOP_OPTIONS]}
    rollout = {param.name: param for group in generated("rollout").values() for param in group}
    for name in ("harness", "group_size", "concurrency", "keep"):
        assert (loop[name].opts, loop[name].help, loop[name].default) == (
            rollout[name].opts,
            rollout[name].help,
            rollout[name].default,
        ), name
    assert loop["group_size"].opts == ["--group-size", "-g"] and loop["concurrency"].opts == [
        "--concurrency",
        "-c",
    ]


def test_every_grpo_option_but_those_the_loop_sets_is_a_loop_option_with_the_same_flag_and_help():
    grpo, loop = all_params_of("grpo"), all_params_of("loop")
    trainer_options = {param.name for param in click_command("grpo").generated_options()[GRPO_OPTIONS]}
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
    loop_trainer = {param.name for param in generated("loop")[GRPO_OPTIONS]}
    assert not (set(LOOP_SETS) & loop_trainer)  # the loop's own spelling, or none


def test_loop_trainer_options_reach_the_loop_config():
    argv = ["tasks.jsonl", "--torch-dtype", "bf16", "--beta", "0.04", "--lr-scheduler", "cosine", "-n", "3"]
    cfg = given_or_resumed_config(parsed("loop", [*argv, "--no-session-weighting"]))
    assert cfg.iterations == 3 and cfg.grpo["torch_dtype"] == "bf16" and cfg.grpo["beta"] == 0.04
    assert cfg.grpo["lr_scheduler_type"] == "cosine" and cfg.grpo["session_weighting"] is False
    assert (
        cfg.grpo["delta"] == 2.0 and cfg.grpo["loss_type"] == "dapo"
    )  # untouched options keep grpo's defaults


def test_builder_names_are_the_merge_builders_and_every_command_offers_them():
    assert set(BuilderName) == set(BUILDERS)
    for argv in (["merge", "--builder", "nonsense"], ["loop", "tasks.jsonl", "--builder", "nonsense"]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2 and all(b.value in result.output for b in BuilderName), argv
        assert all_params_of(argv[0])["builder"].default == BuilderName.prefix_merging
