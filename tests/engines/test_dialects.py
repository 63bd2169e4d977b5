"""The engine dialect registry is the one declaration of the engine kinds: the gateway's `polar_engine` option and
the engine client accept exactly its kinds (and `auto`), and kind detection picks each dialect from what its engine
answers."""

from __future__ import annotations

import typing
from types import SimpleNamespace

import pytest

from polar_mitm.engines.client import EngineClient
from polar_mitm.engines.dialects import DIALECTS, ENGINE_KINDS, engine_kind
from polar_mitm.engines.dialects.base import EngineDialect
from polar_mitm.gateway.options import GatewayOptions, OptionError, mitmproxy_options, parse_options


def _option_values(**overrides: str) -> SimpleNamespace:
    """Every `polar_` option at its default, as mitmproxy hands them to the addon, with `overrides`."""
    values = {option.name: option.default for option in mitmproxy_options()}
    return SimpleNamespace(**{**values, **overrides})


def test_the_engine_option_offers_exactly_the_registrys_kinds():
    engine_type = typing.get_type_hints(GatewayOptions)["engine"]
    assert typing.get_args(engine_type) == ("auto", *ENGINE_KINDS)
    (option,) = [option for option in mitmproxy_options() if option.name == "polar_engine"]
    assert option.choices == ("auto", *ENGINE_KINDS)
    assert all(f"`{kind}`" in option.help for kind in ENGINE_KINDS)


@pytest.mark.parametrize("kind", ["auto", *ENGINE_KINDS])
def test_every_registered_kind_is_accepted_by_the_options_and_the_client(kind):
    assert parse_options(_option_values(polar_engine=kind)).engine == kind
    assert EngineClient("http://127.0.0.1:9", kind=kind).kind_setting == kind


def test_a_kind_the_registry_does_not_know_is_refused_by_both():
    with pytest.raises(OptionError, match="polar_engine must be one of"):
        parse_options(_option_values(polar_engine="tgi"))
    with pytest.raises(ValueError, match="engine kind must be auto or one of"):
        EngineClient("http://127.0.0.1:9", kind="tgi")


def test_the_kind_comes_from_what_the_engine_answers():
    assert all(isinstance(d, EngineDialect) and d.kind == kind for kind, d in DIALECTS.items())
    answers = {
        "embedded": ({"engine": "polar-mitm-embedded", "model_path": "tiny"}, None),
        "sglang": ({"model_path": "Qwen/Qwen3-4B"}, None),
        "vllm": (None, "0.32.0"),
    }
    assert set(answers) == set(ENGINE_KINDS), "a new dialect needs its detection case here"
    for kind, (model_info, server_version) in answers.items():
        assert engine_kind(model_info, server_version) == kind
    with pytest.raises(ValueError):
        engine_kind(None, None)
