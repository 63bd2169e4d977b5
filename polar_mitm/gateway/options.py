"""The gateway's options, declared once: `GatewayOptions` holds each option's type, default and help.

Everything else comes from it: the addon's `load` adds one mitmproxy option per field (`mitmproxy_options`), its
`configure` parses them all into a `GatewayOptions` before applying any (`parse_options`), the gateway reads the
parsed values, and a test checks README's option table against the fields. No mitmproxy import here: the gateway
core stays mitmproxy-free; the addon raises mitmproxy's `OptionsError` from the `OptionError` raised here.

mitmproxy option names are the field names with `polar_` in front. Types map as follows: `str` and `Literal` →
`str` (a `Literal`'s values are the option's choices), `int` → `int`, `bool` → `bool`, `float | None` →
`Optional[str]`, `float` → `str`, `tuple[str, ...]` → `str` (comma-separated). Floats are text options because
mitmproxy's `--set` cannot parse float options. Every number must be ≥ 0.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

PREFIX = "polar_"

Passthrough = Literal["block", "upstream"]
PromptMode = Literal["tokens", "messages"]
StreamMode = Literal["live", "replay"]
EngineKind = Literal["auto", "sglang", "vllm", "embedded"]

# Default completion budget per call (polar_max_tokens): long enough for any real agent turn (a large file written
# in one tool call), short enough that a degenerate sample cannot hold the engine for its whole context.
DEFAULT_MAX_TOKENS = 8192


class OptionError(ValueError):
    """An option value the gateway cannot use; the message names the option (`polar_…`)."""


@dataclass(frozen=True)
class GatewayOptions:
    """The gateway's options (`--set polar_<field>=value`), parsed and checked."""

    backend: str = field(
        default="http://127.0.0.1:30000",
        metadata={"help": "Engine base URL (SGLang, vLLM or `polar-mitm serve`)."},
    )
    engine: EngineKind = field(
        default="auto",
        metadata={
            "help": "The engine's API dialect: `auto` (asked at start: vLLM answers /version, SGLang and "
            "`polar-mitm serve` /model_info), or `sglang`, `vllm`, `embedded`."
        },
    )
    out: str = field(
        default="flows", metadata={"help": "Directory (created if missing) for the Parquet records."}
    )
    passthrough: Passthrough = field(
        default="block",
        metadata={
            "help": "Non-model traffic: `block` (answer locally with a clear 404) or `upstream` (forward)."
        },
    )
    temperature: float | None = field(
        default=None,
        metadata={
            "help": "Force this sampling temperature on every call (RL wants the trainer's temperature)."
        },
    )
    top_p: float | None = field(default=None, metadata={"help": "Force this top_p on every call."})
    max_tokens: int = field(
        default=DEFAULT_MAX_TOKENS,
        metadata={
            "help": "Cap each call's completion tokens, whatever the harness asks (0 = no cap). Bounds a "
            "degenerate RL sample; harnesses that send no max_tokens (Codex) get this budget."
        },
    )
    engine_timeout: int = field(default=600, metadata={"help": "Seconds to wait for the engine per call."})
    rotate_mb: int = field(
        default=64, metadata={"help": "Compact the journal into a Parquet shard at this size."}
    )
    rotate_seconds: int = field(default=300, metadata={"help": "… or at this age."})
    fsync: bool = field(
        default=True,
        metadata={
            "help": "fsync each record before answering (off: a crash may lose the last ~1 s of records)."
        },
    )
    models: tuple[str, ...] = field(
        default=(), metadata={"help": "Extra model ids (comma-separated) for model listings."}
    )
    max_body_mb: int = field(
        default=64,
        metadata={
            "help": "Largest request body in MiB, compressed or decoded; larger ones get a provider-shaped "
            "413."
        },
    )
    prompt_mode: PromptMode = field(
        default="tokens",
        metadata={
            "help": "`tokens`: send the engine the session's exact token stream + the new tail (every sampled "
            "token trained in the context it was sampled in); `messages`: the engine renders the "
            "harness's messages."
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "Engine tokenizer for tokens mode (a local path; empty: the engine's /model_info path)."
        },
    )
    stream: StreamMode = field(
        default="live",
        metadata={
            "help": "Streamed calls: `live` (the engine streams; the harness gets events as tokens are "
            "sampled) or `replay` (answer whole from the engine, then replay it as SSE; for engines "
            "that cannot stream ids)."
        },
    )
    keepalive_seconds: float = field(
        default=10.0,
        metadata={
            "help": "Live streams: send the provider's keep-alive (Anthropic ping, SSE comment) after this "
            "many seconds of silence, so harness idle timeouts do not fire (0 = never)."
        },
    )
    shutdown_grace_seconds: float = field(
        default=10.0,
        metadata={
            "help": "On SIGTERM, how long calls in flight may run on to their end; then they are aborted and "
            "recorded `abort` with what was sampled, and the gateway exits."
        },
    )

    # -- what the gateway derives from them ----------------------------------------------------------------------

    @property
    def max_body_bytes(self) -> int:
        """Larger request bodies (raw or decoded) get a 413."""
        return self.max_body_mb << 20

    @property
    def completion_cap(self) -> int | None:
        """The cap on each call's max_tokens; None: the harness's own."""
        return self.max_tokens or None


@dataclass(frozen=True)
class MitmOption:
    """One `loader.add_option` call: mitmproxy's name, typespec, default, help and choices."""

    name: str
    typespec: Any
    default: Any
    help: str
    choices: tuple[str, ...] | None = None


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(GatewayOptions)


def mitmproxy_options() -> list[MitmOption]:
    """The mitmproxy options of `GatewayOptions`, in declaration order."""
    types = _field_types()
    options = []
    for f in dataclasses.fields(GatewayOptions):
        kind = types[f.name]
        choices = tuple(typing.get_args(kind)) if typing.get_origin(kind) is Literal else None
        if kind in (str, int, bool) or choices:
            typespec, default = (str if choices else kind), f.default
        elif kind == float | None:
            typespec, default = Optional[str], None  # noqa: UP045 (mitmproxy typespec)
        elif kind is float:
            typespec, default = str, f"{f.default:g}"
        elif kind == tuple[str, ...]:
            typespec, default = str, ",".join(f.default)
        else:
            raise TypeError(f"GatewayOptions.{f.name}: no mitmproxy option type for {kind}")
        options.append(MitmOption(PREFIX + f.name, typespec, default, f.metadata["help"], choices))
    return options


def parse_options(values: Any) -> GatewayOptions:
    """`GatewayOptions` from the mitmproxy option values (an object with a `polar_<field>` attribute per field).

    Raises `OptionError` naming the first option whose value the gateway cannot use.
    """
    types = _field_types()
    parsed = {
        f.name: _parse(PREFIX + f.name, types[f.name], getattr(values, PREFIX + f.name))
        for f in dataclasses.fields(GatewayOptions)
    }
    return GatewayOptions(**parsed)


def _parse(name: str, kind: Any, value: Any) -> Any:
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise OptionError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        return value
    if kind is int:
        if value < 0:
            raise OptionError(f"{name} must be ≥ 0, got {value}")
        return value
    if kind == float | None:
        return _number(name, value)
    if kind is float:
        return _number(name, value) or 0.0
    if kind == tuple[str, ...]:
        return tuple(item.strip() for item in value.split(",") if item.strip())
    return value


def _number(name: str, value: str | None) -> float | None:
    """A number given as text (empty: None); OptionError names the option."""
    if value in (None, ""):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except ValueError as exc:
        raise OptionError(f"{name} must be a number, got {value!r}") from exc
    if math.isnan(number) or number < 0:
        raise OptionError(f"{name} must be a number ≥ 0, got {value!r}")
    return number
