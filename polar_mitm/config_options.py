"""Command-line options generated from config dataclasses, so that each option is declared once: as a field, with its
type, default and help.

A field's help is `metadata["help"]` (as in TRL's configs); where the command line spells the field otherwise than
`--field-name` (short flags, a positional argument, another default or type), `option(...)` says so in the same
metadata, and `python_only(...)` marks a field no command sets. `field_options` turns fields into click parameters
(Typer builds them, so they parse and check values as hand-written `typer.Option`s do), and `ConfigOptionsCommand`
adds them to a command the first time it is parsed or helped, with `--config FILE` and `--show-config`
(config_file.py). `polar-mitm rollout` (rollout/cli.py), `loop` (loop/cli.py) and `grpo` (train/config_options.py)
take their options from here.
"""

from __future__ import annotations

import dataclasses
import inspect
import shutil
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

HELP = "help"  # metadata key: the field's help text
OPTION = "polar_option"  # metadata key: the field's FieldOption, or None where no command sets it
CONFIG_FIELDS = "polar_config_fields"  # ctx.meta key: the generated options' values, by group and field name
FIELD_DEFAULT: Any = object()  # a `FieldOption.default` that keeps the field's own


@dataclasses.dataclass(frozen=True)
class FieldOption:
    """How a config field reads on the command line where that differs from the field itself."""

    flags: tuple[
        str, ...
    ] = ()  # default: --field-name (a bool: --field-name/--no-field-name); else used as given
    default: Any = FIELD_DEFAULT
    help: str | None = None  # default: the field's `metadata["help"]`
    type: Any = None  # default: the field's annotation
    argument: bool = False  # a positional argument, not an option


def option(
    help: str, *flags: str, default: Any = FIELD_DEFAULT, type: Any = None, argument: bool = False
) -> dict[str, Any]:
    """A field's metadata: its help, and how its command-line option differs from `--field-name`, if it does."""
    return {HELP: help, OPTION: FieldOption(flags, default, None, type, argument)}


def python_only(help: str) -> dict[str, Any]:
    """A field's metadata: its help, for a field set from Python (or by the command itself), never an option."""
    return {HELP: help, OPTION: None}


def field_metadata(config_class: type, name: str) -> Mapping[str, Any]:
    """A field's whole metadata, for a field of another config that is the same setting (its help and spelling)."""
    return {f.name: f for f in dataclasses.fields(config_class)}[name].metadata


def option_fields(config_class: type) -> list[str]:
    """The fields of `config_class` that are command-line options (all but `python_only` ones), in order."""
    return [
        f.name for f in dataclasses.fields(config_class) if f.metadata.get(OPTION, FieldOption()) is not None
    ]


def field_options(
    config_class: type,
    names: Iterable[str] | None = None,
    *,
    overrides: Mapping[str, FieldOption] | None = None,
    panel: str | None = None,
) -> list:
    """The click parameters (built by Typer) of `config_class`'s fields `names` (default: `option_fields`), each with
    the field's default and help, spelt as its metadata's `option(...)` or as `overrides` (by field name) say.
    A field without help is refused: every option says what it does."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    types = typing.get_type_hints(config_class)
    chosen = option_fields(config_class) if names is None else list(names)
    parameters = [
        _parameter(config_class, fields[name], types[name], (overrides or {}).get(name), panel)
        for name in chosen
    ]

    def fields_only(**values: Any) -> None:
        """Never called: Typer reads its signature."""

    fields_only.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    builder = typer.Typer(add_completion=False)
    builder.command()(fields_only)
    return list(typer.main.get_command(builder).params)


def _parameter(
    config_class: type,
    field: dataclasses.Field,
    annotation: Any,
    override: FieldOption | None,
    panel: str | None,
) -> inspect.Parameter:
    """The signature parameter Typer makes the field's option (or argument) of."""
    where = f"{config_class.__name__}.{field.name}"
    spelling = override or field.metadata.get(OPTION, FieldOption())
    if spelling is None:
        raise ValueError(f"{where} is set from Python only, not a command-line option")
    help_text = spelling.help or field.metadata.get(HELP)
    if not help_text:
        raise ValueError(f"{where} has no metadata['help'] for its command-line option")
    default = spelling.default
    if default is FIELD_DEFAULT:
        default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
    if default is dataclasses.MISSING:
        default = inspect.Parameter.empty  # a required option or argument
    annotation = spelling.type or annotation
    if default is not None:  # `bool | None = False` is a plain --flag/--no-flag
        annotation = _without_none(annotation)
    make = typer.Argument if spelling.argument else typer.Option
    declared = make(*spelling.flags, help=help_text, rich_help_panel=panel)
    return inspect.Parameter(
        field.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[annotation, declared],
    )


def _without_none(annotation: Any) -> Any:
    args = typing.get_args(annotation)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]  # noqa: UP007
    return annotation


RICH_HELP_MIN_COLUMNS = 100  # narrower: the plain help layout (ConfigOptionsCommand.format_help)


class ConfigOptionsCommand(TyperCommand):
    """A command with generated config options (`generated_options()` of a subclass, in named groups, each usually
    one config's fields): they are added after the command's own when it is first parsed or helped, not when the app
    is built — importing TRL takes seconds that the other commands should not pay. Each group's values reach the
    command as `option_values(ctx, group)`, not as arguments of its function."""

    generated: dict[str, list] | None = None

    def generated_options(self) -> dict[str, list]:
        raise NotImplementedError

    def get_params(self, ctx: typer.Context) -> list:
        if self.generated is None:
            self.generated = self.generated_options()
            from polar_mitm.config_file import config_params

            added = [param for params in self.generated.values() for param in params]
            added += config_params()  # --config FILE, --show-config
            names = [param.name for param in [*self.params, *added]]
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:
                raise ValueError(f"{self.name}: two options set {twice}")
            self.params.extend(added)
        return super().get_params(ctx)

    def generated_values(self, ctx: typer.Context) -> dict[str, dict[str, Any]]:
        """The generated options' parsed values by group and field name, taken out of `ctx.params`."""
        return {
            group: {param.name: ctx.params.pop(param.name) for param in params}
            for group, params in (self.generated or {}).items()
        }

    def format_help(self, ctx: typer.Context, formatter) -> None:
        """Rich's option table below 100 columns cuts long option names (`--gradient-accumula…`): there, click's
        plain layout, which keeps every name whole and wraps the help beside it."""
        if shutil.get_terminal_size((80, 24)).columns >= RICH_HELP_MIN_COLUMNS:
            return super().format_help(ctx, formatter)
        rich_mode, self.rich_markup_mode = self.rich_markup_mode, None
        try:
            return super().format_help(ctx, formatter)
        finally:
            self.rich_markup_mode = rich_mode

    def invoke(self, ctx: typer.Context) -> Any:
        from polar_mitm.config_file import SHOW_CONFIG, show_config

        if ctx.meta.get(SHOW_CONFIG):  # the resolved options, for --config; nothing runs
            typer.echo(show_config(ctx), nl=False)
            return None
        ctx.meta[CONFIG_FIELDS] = self.generated_values(ctx)
        return super().invoke(ctx)


def option_values(ctx: typer.Context, group: str) -> dict[str, Any]:
    """One group of a `ConfigOptionsCommand`'s generated options: their values, by field name."""
    return ctx.meta[CONFIG_FIELDS][group]
