"""The gateway's options, declared once: `GatewayOptions` holds each option's type, default and help.

Everything else comes from it: the addon's `load` adds one mitmproxy option per field (`mitmproxy_options`), its
`configure` parses them all into a `GatewayOptions` before applying any (`parse_options`), the gateway reads the
parsed values, and a test checks README's option table against the fields. No mitmproxy import here: the gateway
core stays mitmproxy-free; the addon raises mitmproxy's `OptionsError` from the `OptionError` raised here.

mitmproxy option names are the field names with `polar_` in front. Types map as follows: `str` and `Literal` →
`str` (a `Literal`'s values are the option's choices), `int` → `int`, `bool` → `bool`, `float | None` →
`Optional[str]`, `float` → `str`, `tuple[str, ...]` → `str` (comma-separated). Floats are text options because
mitmproxy's `--set` cannot parse float options. Every number must be finite and ≥ 0; a field's `range` metadata
narrows that (`Range`), and `backend` and `out` are checked for what the gateway does with them. Values are checked
here, once, for the start and for control calls alike.
"""

from __future__ import annotations

import dataclasses
import math
import typing
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from polar_mitm.engine.tool_call_formats import TOOL_CALL_PARSER_NAMES
from polar_mitm.engines.dialects import ENGINE_KINDS

PREFIX = "polar_"

Passthrough = Literal["block", "upstream"]
PromptMode = Literal["tokens", "messages"]
StreamMode = Literal["live", "replay"]
# `auto` or a kind of the engine dialect registry, which declares the kinds (a new dialect is a new choice here).
EngineKind = Literal[("auto", *ENGINE_KINDS)]  # type: ignore[valid-type]
# `auto` or a tool-call notation of the parser registry (engine/tool_call_formats.py), or `none`.
ToolCallParser = Literal[("auto", *TOOL_CALL_PARSER_NAMES)]  # type: ignore[valid-type]

# What a control call may do is decided when the gateway starts: these are never changed while it runs.
STARTUP_ONLY = ("control_may_weaken", "control_may_move_out", "base_url_port")

# Default completion budget per call (polar_max_tokens): long enough for any real agent turn (a large file written
# in one tool call), short enough that a degenerate sample cannot hold the engine for its whole context.
DEFAULT_MAX_TOKENS = 8192


class OptionError(ValueError):
    """An option value the gateway cannot use; the message names the option (`polar_…`)."""


@dataclass(frozen=True)
class Range:
    """The values a number option may take beyond finite and ≥ 0: from `low` (excluded when `low_open`) up to
    `high`, or 0 where that is the option's "off" (`zero_allowed`)."""

    low: float = 0.0
    low_open: bool = False
    high: float = math.inf
    zero_allowed: bool = False

    def admits(self, number: float) -> bool:
        if self.zero_allowed and number == 0:
            return True
        above = number > self.low if self.low_open else number >= self.low
        return above and number <= self.high

    def describe(self) -> str:
        low = f"> {self.low:g}" if self.low_open else f"≥ {self.low:g}"
        text = low if self.high == math.inf else f"{low} and ≤ {self.high:g}"
        return f"0 or {text}" if self.zero_allowed else text


@dataclass(frozen=True)
class GatewayOptions:
    """The gateway's options (`--set polar_<field>=value`), parsed and checked."""

    backend: str = field(
        default="http://127.0.0.1:30000",
        metadata={
            "help": "Engine base URL (SGLang, vLLM or `polar-mitm serve`): http:// or https:// with a host."
        },
    )
    engine: EngineKind = field(
        default="auto",
        metadata={
            "help": "The engine's API dialect: `auto` (asked at start: vLLM answers /version, SGLang and "
            f"`polar-mitm serve` /model_info), or {', '.join(f'`{kind}`' for kind in ENGINE_KINDS)}."
        },
    )
    out: str = field(
        default="flows",
        metadata={
            "help": "Directory (created if missing) for the Parquet records: a local path, not empty, no `=` or newline."
        },
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
            "help": "Force this sampling temperature on every call (RL wants the trainer's temperature); "
            "finite, ≥ 0."
        },
    )
    top_p: float | None = field(
        default=None,
        metadata={
            "help": "Force this top_p on every call; > 0 and ≤ 1.",
            "range": Range(0, low_open=True, high=1),
        },
    )
    max_tokens: int = field(
        default=DEFAULT_MAX_TOKENS,
        metadata={
            "help": "Cap each call's completion tokens, whatever the harness asks (0 = no cap). Bounds a "
            "degenerate RL sample; harnesses that send no max_tokens (Codex) get this budget."
        },
    )
    engine_timeout: int = field(
        default=600,
        metadata={"help": "Seconds to wait for the engine per call (≥ 1).", "range": Range(1)},
    )
    rotate_mb: int = field(
        default=64,
        metadata={
            "help": "Compact the journal into a Parquet shard at this size (≥ 1: 0 would compact after "
            "every record).",
            "range": Range(1),
        },
    )
    rotate_seconds: int = field(
        default=300,
        metadata={
            "help": "… or at this age (≥ 1: the writer wakes this often, and 0 keeps it busy on an idle "
            "gateway).",
            "range": Range(1),
        },
    )
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
            "413 (≥ 1).",
            "range": Range(1),
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
    tool_call_parser: ToolCallParser = field(
        default="auto",
        metadata={
            "help": "vLLM: the tool-call notation the gateway parses vLLM's raw text with (vLLM returns it "
            "unparsed on the token-in path), e.g. `qwen3_coder` for Qwen3-Coder's XML; `auto`: the one "
            "`polar-mitm vllm serve --tool-call-parser` named, `hermes` for a vLLM started otherwise. SGLang and "
            "the embedded engine parse with their own `--tool-call-parser`."
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
            "many seconds of silence, so harness idle timeouts do not fire (0 = never; else ≥ 0.05: a "
            "shorter one floods the stream with keep-alives and busies the gateway).",
            "range": Range(0.05, zero_allowed=True),
        },
    )
    shutdown_grace_seconds: float = field(
        default=10.0,
        metadata={
            "help": "On SIGTERM, how long calls in flight may run on to their end; then they are aborted and "
            "recorded `abort` with what was sampled, and the gateway exits."
        },
    )
    max_headers: int = field(
        default=1000,
        metadata={
            "help": "Most header lines a request may carry; more get a provider-shaped 431 at the headers "
            "(mitmproxy has no HTTP/1 limit; h2 caps an HTTP/2 header list at 64 KiB). ≥ 1.",
            "range": Range(1),
        },
    )
    max_header_kb: int = field(
        default=256,
        metadata={
            "help": "Largest total size in KiB of a request's header names and values; larger gets a "
            "provider-shaped 431 at the headers. ≥ 1.",
            "range": Range(1),
        },
    )
    base_url_port: int = field(
        default=0,
        metadata={
            "help": "Start-up only: serve base-URL calls on the gateway's own HTTP server at this port (on "
            "mitmproxy's listen_host), not through mitmproxy (`--mode reverse:`), whose request handling costs "
            "more CPU than the gateway; 0: off. No proxyauth there: a base URL a password must guard uses "
            "`--mode reverse:`.",
            "range": Range(high=65535),
        },
    )
    control_may_weaken: bool = field(
        default=False,
        metadata={
            "help": "Start-up only: control calls may open passthrough (`polar_passthrough` other than "
            "`block`) or turn `polar_fsync` off; refused (403) otherwise."
        },
    )
    control_may_move_out: bool = field(
        default=True,
        metadata={
            "help": "Start-up only: control calls may move the records folder (`polar_out`), which is how "
            "the RL loop points one gateway at each rollout; `false` for a gateway that is never moved."
        },
    )

    # -- what the gateway derives from them ----------------------------------------------------------------------

    @property
    def max_body_bytes(self) -> int:
        """Larger request bodies (raw or decoded) get a 413."""
        return self.max_body_mb << 20

    @property
    def max_header_bytes(self) -> int:
        """Requests whose header names and values add up to more get a 431."""
        return self.max_header_kb << 10

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
    parsed = {}
    for f in dataclasses.fields(GatewayOptions):
        name = PREFIX + f.name
        value = _parse(name, types[f.name], getattr(values, name))
        allowed: Range | None = f.metadata.get("range")
        if allowed is not None and value is not None and not allowed.admits(value):
            raise OptionError(f"{name} must be {allowed.describe()}, got {value:g}")
        parsed[f.name] = value
    _check_backend(parsed["backend"])
    _check_out(parsed["out"])
    return GatewayOptions(**parsed)


def _check_backend(url: str) -> None:
    """An http(s) URL with a host: anything else fails every call later (503), so it fails here."""
    name = PREFIX + "backend"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        raise OptionError(f"{name} must be an http:// or https:// URL, got {url!r} ({exc})") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OptionError(f"{name} must be an http:// or https:// URL with a host, got {url!r}")


def _check_out(out: str) -> None:
    """A folder the writer opens as a local path: not empty (the working directory by accident), and no newline
    or `=` (they split `--set` texts and lines of the logs and reports that name the folder)."""
    name = PREFIX + "out"
    if not out.strip():
        raise OptionError(f"{name} must name a folder, got {out!r}")
    if "=" in out or any(not char.isprintable() for char in out):
        raise OptionError(f"{name} must not contain '=' or control characters (newlines), got {out!r}")


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
    if not math.isfinite(number) or number < 0:
        raise OptionError(f"{name} must be a finite number ≥ 0, got {value!r}")
    return number
