"""The gateway's options are declared once (`GatewayOptions`) and the addons keep mitmproxy's option contract.

mitmproxy's contract (`mitmproxy/addons/blocklist.py`): `configure` parses and checks every value first and raises
`OptionsError`, and mitmproxy then rolls the change back. Here each bad value is set the way mitmproxy's `set`
command sets it (`options.set("name=value")`, on the running addons inside `taddons.context`): it must be refused,
the old value must stay, and nothing built from the options (the addons' shared core) may be rebuilt.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mitmproxy.exceptions import OptionsError
from mitmproxy.test import taddons

from polar_mitm.gateway.addons import gateway_addons
from polar_mitm.gateway.addons.core import GatewayCore
from polar_mitm.gateway.options import PREFIX, GatewayOptions, PromptMode, mitmproxy_options
from polar_mitm.gateway.prompts import PROMPT_MODES

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_defaults() -> dict[str, str]:
    """README's gateway option table: option name → its default as the table writes it."""
    defaults = {}
    for line in README.read_text().splitlines():
        if not line.startswith("| `polar_"):
            continue
        names_cell, default_cell = line.split("|")[1:3]
        names = re.findall(r"`(polar_\w+)`", names_cell)
        values = re.findall(r"`([^`]*)`", default_cell) or [default_cell.strip()] * len(names)
        assert len(values) == len(names), line
        defaults.update(zip(names, values, strict=True))
    return defaults


def as_readme(default: Any) -> str:
    if default is None:
        return "unset"
    if default == "":
        return "empty"
    if isinstance(default, bool):
        return str(default).lower()
    return str(default)


def test_readme_lists_every_gateway_option_with_its_declared_default():
    declared = {option.name: as_readme(option.default) for option in mitmproxy_options()}
    assert readme_defaults() == declared


def test_every_option_has_help_and_the_fixed_sets_are_the_prompt_builders():
    assert all(f.metadata.get("help") for f in dataclasses.fields(GatewayOptions))
    assert typing.get_args(PromptMode) == PROMPT_MODES


def test_load_declares_each_field_as_a_mitmproxy_option():
    with taddons.context(*gateway_addons()) as tctx:
        for option in mitmproxy_options():
            assert tctx.options.default(option.name) == option.default
    assert {option.name for option in mitmproxy_options()} == {
        PREFIX + f.name for f in dataclasses.fields(GatewayOptions)
    }


@pytest.fixture
def running(tmp_path) -> Iterator[tuple[GatewayCore, Any]]:
    """The configured addons past startup (where a bad option is refused, not fatal), in mitmproxy's test context;
    their shared core is what the options build."""
    core = GatewayCore()
    addons = gateway_addons(core)
    with taddons.context(*addons) as tctx:
        tctx.configure(addons[0], polar_out=str(tmp_path / "flows"), polar_backend="http://127.0.0.1:9")
        core.is_running = True  # what the `running` hook sets
        try:
            yield core, tctx
        finally:
            if core.writer is not None:
                core.writer.close()


BAD_VALUES = [
    "polar_passthrough=forward",
    "polar_prompt_mode=words",
    "polar_stream=later",
    "polar_max_tokens=-1",
    "polar_max_tokens=many",
    "polar_engine_timeout=-5",
    "polar_rotate_mb=-1",
    "polar_rotate_seconds=-1",
    "polar_max_body_mb=-64",
    "polar_temperature=hot",
    "polar_temperature=-0.5",
    "polar_top_p=nan",
    "polar_keepalive_seconds=soon",
    "polar_shutdown_grace_seconds=-1",
    "polar_fsync=maybe",
    "polar_out=FILE",
    "polar_temperature=inf",
    "polar_top_p=0",
    "polar_backend=file:///engine",
    "polar_max_body_mb=0",
    "polar_rotate_seconds=0",
    "polar_keepalive_seconds=0.0001",
    "polar_max_headers=0",
    "polar_max_header_kb=0",
    "polar_control_may_weaken=true",  # start-up only
    "polar_control_may_move_out=false",
]
PARSED_BY_MITMPROXY = {"polar_max_tokens=many", "polar_fsync=maybe"}  # its message does not name the option


@pytest.mark.parametrize("spec", BAD_VALUES)
def test_a_bad_value_set_at_run_time_is_refused_and_changes_nothing(running, tmp_path, spec):
    core, tctx = running
    name = spec.split("=", 1)[0]
    (tmp_path / "FILE").write_text("not a folder")
    old_value = getattr(tctx.options, name)
    built = (core.options, core.writer, core.engine, core.prompts, core.gateway)
    with pytest.raises(OptionsError, match=None if spec in PARSED_BY_MITMPROXY else name):
        tctx.options.set(spec.replace("=FILE", f"={tmp_path / 'FILE'}"))
    assert getattr(tctx.options, name) == old_value
    assert (core.options, core.writer, core.engine, core.prompts, core.gateway) == built
    assert all(
        new is old
        for new, old in zip(
            (core.options, core.writer, core.engine, core.prompts, core.gateway), built, strict=True
        )
    )


def test_a_good_value_rebuilds_only_what_it_concerns_and_numbering_goes_on(running):
    core, tctx = running
    writer, engine, prompts, gateway = core.writer, core.engine, core.prompts, core.gateway
    gateway.seed_sequences({"s1": 4})
    tctx.options.set("polar_max_tokens=100")
    assert core.options.max_tokens == 100 and core.gateway.config.completion_cap == 100
    assert core.gateway is not gateway
    assert (core.writer, core.engine, core.prompts) == (writer, engine, prompts)
    assert next(core.gateway._seq["s1"]) == 5
    tctx.options.set("polar_engine_timeout=30")
    assert core.engine is not engine and core.writer is writer
    before = core.gateway
    tctx.options.update(showhost=True)  # not ours: nothing rebuilt
    assert core.gateway is before


def test_a_bad_value_before_startup_stops_the_process(tmp_path, capsys):
    core = GatewayCore()
    addons = gateway_addons(core)
    with taddons.context(*addons) as tctx, pytest.raises(SystemExit):
        tctx.configure(addons[0], polar_out=str(tmp_path / "flows"), polar_max_tokens=-1)
    assert "polar-mitm: polar_max_tokens must be ≥ 0, got -1" in capsys.readouterr().err
    assert core.writer is None and core.gateway is None
