"""The option generator (polar_mitm/config_options.py): a field's metadata spells its option, the values reach the
command by group, and a field that cannot be an option (no help, Python only, a name taken twice) is refused."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from polar_mitm.config_options import (
    ConfigOptionsCommand,
    field_options,
    option,
    option_fields,
    option_values,
    python_only,
)


@dataclass
class Example:
    source: Path = field(metadata=option("Where from.", argument=True))
    out: Path = field(metadata=option("Where to.", "--out", "-o", default=Path("out")))
    count: int = field(default=2, metadata=option("How many.", "--count", "-n"))
    label: str | None = field(default=None, metadata={"help": "A plain field: --label."})
    dry_run: bool = field(default=False, metadata=option("Only say what would run.", "--dry-run"))
    shuffle: bool = field(default=True, metadata=option("Shuffle first."))
    handle: object = field(default=None, metadata=python_only("Set from Python."))


@dataclass
class Other:
    label: str = field(default="x", metadata=option("Another label."))


def params_of(config: type, **kwargs) -> dict:
    return {param.name: param for param in field_options(config, **kwargs)}


def test_the_metadata_spells_each_option():
    params = params_of(Example)
    assert list(params) == option_fields(Example) == ["source", "out", "count", "label", "dry_run", "shuffle"]
    assert params["source"].param_type_name == "argument" and params["source"].required
    assert (params["out"].opts, params["out"].default) == (["--out", "-o"], Path("out"))
    assert params["count"].opts == ["--count", "-n"] and params["count"].help == "How many."
    assert params["label"].opts == ["--label"] and params["label"].default is None
    assert (params["dry_run"].opts, params["dry_run"].secondary_opts) == (["--dry-run"], [])
    assert (params["shuffle"].opts, params["shuffle"].secondary_opts) == (["--shuffle"], ["--no-shuffle"])


class ExampleCommand(ConfigOptionsCommand):
    def generated_options(self) -> dict[str, list]:
        return {"example": field_options(Example)}


def test_the_values_reach_the_command_by_group_and_build_the_config():
    seen = {}

    def command(ctx: typer.Context, verbose: bool = False) -> None:
        seen.update(verbose=verbose, config=Example(**option_values(ctx, "example")))

    single = typer.Typer(add_completion=False)
    single.command("example", cls=ExampleCommand)(command)
    result = CliRunner().invoke(
        single, ["in", "-o", "there", "-n", "5", "--dry-run", "--no-shuffle", "--verbose"]
    )
    assert result.exit_code == 0, result.output
    assert seen["verbose"] is True
    assert seen["config"] == Example(Path("in"), Path("there"), 5, None, True, False)
    bad = CliRunner().invoke(single, ["in", "-n", "many"])
    assert bad.exit_code == 2 and "Invalid value for '--count'" in bad.output


def test_a_field_without_help_or_set_from_python_only_is_no_option():
    @dataclass
    class Undocumented:
        knob: int = 3

    with pytest.raises(ValueError, match="Undocumented.knob has no metadata"):
        field_options(Undocumented)
    with pytest.raises(ValueError, match="Example.handle is set from Python only"):
        field_options(Example, ["handle"])


def test_two_groups_setting_one_name_are_refused():
    class Twice(ConfigOptionsCommand):
        def generated_options(self) -> dict[str, list]:
            return {"example": field_options(Example), "other": field_options(Other)}

    command = Twice("twice", callback=lambda: None)
    with pytest.raises(ValueError, match=r"two options set \['label'\]"):
        command.get_params(command.make_context("twice", ["in"], resilient_parsing=True))


@pytest.mark.parametrize("command", ["rollout", "loop", "grpo"])
def test_help_fits_80_columns_with_every_option_name_whole(command):
    """Rich's table cut 19-20 long names at 80 columns (`--gradient-accumula…`); below 100 the help is plain."""
    from polar_mitm.cli import app

    result = CliRunner().invoke(app, [command, "-h"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    click_command = typer.main.get_command(app).commands[command]
    ctx = click_command.make_context(command, ["-h"], resilient_parsing=True)
    for param in click_command.get_params(ctx):
        for flag in [opt for opt in getattr(param, "opts", []) if opt.startswith("--")]:
            assert flag in result.output, flag
