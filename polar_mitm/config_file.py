"""`--config FILE.yaml` and `--show-config` for the commands whose options come from configs (`rollout`, `loop`,
`grpo`): a run kept in a file instead of a 40-flag command line.

The file's keys are the options' names, spelt as the flags are (`max-tokens`) or as fields (`max_tokens`); values
are YAML. They become click's `default_map`, so every value is parsed and checked exactly as the flag's would be, and
a flag given on the command line overrides the file. An unknown key is refused with the likely one named; the
file's own errors (not YAML, not a mapping) are one line naming it. `--show-config` prints what the command would
run with — the file, the flags and the defaults resolved — as YAML that `--config` reads back, and runs nothing.
"""

from __future__ import annotations

import difflib
import enum
from pathlib import Path
from typing import Annotated, Any

import typer

from polar_mitm.user_errors import UserInputError

SHOW_CONFIG = "polar_show_config"  # ctx.meta key: --show-config was given


def config_params() -> list:
    """The two options every config-generated command has (built by Typer, as `field_options`' are)."""

    def options(
        config: Annotated[
            Path | None,
            typer.Option(
                "--config",
                is_eager=True,  # before every other option: the file's values are their defaults
                expose_value=False,
                callback=_load_into_context,
                dir_okay=False,
                help="YAML file of this command's options (keys as the flags, `max-tokens` or `max_tokens`); "
                "flags given override it.",
            ),
        ] = None,
        show_config: Annotated[
            bool,
            typer.Option(
                "--show-config",
                expose_value=False,
                callback=_note_show,
                help="Print the resolved options (file, flags, defaults) as YAML for --config; run nothing.",
            ),
        ] = False,
    ) -> None:
        """Never called: Typer reads its signature."""

    builder = typer.Typer(add_completion=False)
    builder.command()(options)
    return list(typer.main.get_command(builder).params)


def _load_into_context(ctx: typer.Context, path: Path | None) -> None:
    if path is not None:
        ctx.default_map = {**(ctx.default_map or {}), **read_config(path, ctx.command)}


def _note_show(ctx: typer.Context, value: bool) -> None:
    ctx.meta[SHOW_CONFIG] = value


def read_config(path: Path, command) -> dict[str, Any]:
    """The file's values by parameter name; raises UserInputError naming the file and the key."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserInputError(f"--config {path}: {' '.join(str(exc).split())}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserInputError(
            f"--config {path}: a mapping of option names to values, not {type(loaded).__name__}"
        )
    names: dict[
        str, str
    ] = {}  # a field's name and each of its long flags (`engine_url`, `engine`) → the name
    for param in command.params:
        if param.name and param.expose_value:
            names[param.name] = param.name
            for flag in getattr(param, "opts", []):
                if flag.startswith("--"):
                    names.setdefault(flag[2:].replace("-", "_"), param.name)
    values = {}
    for key, value in loaded.items():
        name = names.get(str(key).lstrip("-").replace("-", "_"))
        if name is None:
            name = str(key).lstrip("-").replace("-", "_")
            likely = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
            hint = f": did you mean {likely[0].replace('_', '-')}?" if likely else ""
            raise UserInputError(
                f"--config {path}: {key!r} is no option of `polar-mitm {command.name}`{hint} "
                f"(`polar-mitm {command.name} -h` lists them)"
            )
        values[name] = value
    return values


def show_config(ctx: typer.Context) -> str:
    """The command's resolved option values as YAML (what `--show-config` prints)."""
    import yaml

    shown = {
        _key(param): _plain(ctx.params[param.name])
        for param in ctx.command.params
        if param.name in ctx.params
    }
    return yaml.safe_dump(shown, sort_keys=False, allow_unicode=True)


def _key(param) -> str:
    """The option's key in a config file: its first long flag (`engine` for `--engine`), or its name."""
    flags = [flag[2:] for flag in getattr(param, "opts", []) if flag.startswith("--")]
    return flags[0] if flags else param.name.replace("_", "-")


def _plain(value: Any) -> Any:
    """A value YAML writes as `--config` reads it back (paths as text, enums by value, tuples as lists)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


CONFIG_COMMANDS = ("rollout", "loop", "grpo", "serve-rollouts")  # the commands that take --config

config_app = typer.Typer(
    help="Config files of rollout, loop and grpo (--config FILE.yaml).", no_args_is_help=True
)


@config_app.command(
    "show",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
)
def config_show(
    ctx: typer.Context,
    command: Annotated[
        str, typer.Argument(help="rollout | loop | grpo, then its options (and --config FILE).")
    ],
) -> None:
    """Print the options COMMAND would run with (a --config file, the flags, the defaults) as YAML; runs nothing.
    The same as `polar-mitm COMMAND … --show-config`; save it and pass it back with --config."""
    if command not in CONFIG_COMMANDS:
        raise UserInputError(f"config show {command}: one of {', '.join(CONFIG_COMMANDS)}")
    root = ctx.find_root().command  # the `polar-mitm` group this runs under
    root.main(args=[command, *ctx.args, "--show-config"], prog_name="polar-mitm", standalone_mode=False)
