"""The one interface every engine dialect implements, and what all of them share: the weight-version fields.

A dialect is what differs between engine kinds, declared on its class: how the engine is recognised from what it
answers, where its model info and weight version are read, how a chat call, a token-in call and a stream are sent
and their answers brought into SGLang's shape (the gateway's own), how a call is aborted, and how new weights are
pushed under running calls (pausing with the calls kept and resuming where the engine has that; `PushReport`
says the pause they saw). A dialect does no I/O of its own: the callers hand it
their transport — the gateway's pooled aiohttp client (`engines/client.py`, `AsyncEngine`) and the weight pushes'
blocking httpx calls (`engines/weights.py`, `BlockingEngine`) — and it says which paths and bodies to send and how
to read what comes back. The registry (`dialects/__init__.py`) picks a dialect once per engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    import httpx

# Engine answers larger than this are parsed and translated in a worker thread, off the gateway's event loop.
OFFLOAD_BYTES = 32 << 10

T = TypeVar("T")


class EngineSyncError(RuntimeError):
    """The engine did not take the new weights (unreachable, or it answered success=false)."""


@dataclass
class PushReport:
    """What one weight push did: the version the engine then serves, how long running calls sampled nothing
    because of it (`pause_seconds`: vLLM's pause→resume, SGLang's pause→continue, the embedded engine's swap and
    re-prefill; 0 when nothing ran), how running calls were treated (`mode`), and the push's whole time."""

    weight_version: str
    pause_seconds: float
    mode: str  # keep | wait | swap | retract | abort (aborted calls are resumed by the gateway)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "pause_seconds": round(self.pause_seconds, 4),
            "mode": self.mode,
            "seconds": round(self.seconds, 4),
        }


class AsyncEngine(Protocol):
    """The gateway's client to one engine (`engines/client.py`): failures are `GatewayError`s (`overloaded` when
    the engine is down or timed out, `engine_error`/`invalid_request`/`context_length` for what it answered)."""

    base_url: str

    async def request(self, method: str, path: str, body: bytes | None = None) -> bytes: ...

    async def get_json(self, path: str) -> Any: ...

    async def weight_version(self) -> str | None: ...

    async def model_info(self) -> dict[str, Any]: ...


class BlockingEngine(Protocol):
    """Blocking calls to one engine for weight pushes (`engines/weights.py`): an engine that cannot be reached (or,
    for `get_json`, answers an error status) raises `EngineSyncError`."""

    url: str

    def get_json(self, path: str, *, timeout: float) -> Any: ...

    def post(self, path: str, body: dict[str, Any] | None, *, timeout: float) -> httpx.Response: ...


class StreamTranslator(Protocol):
    """An engine's streamed chunks → SGLang's (`feed` per chunk, `finish` once at the end, also after an abort)."""

    def feed(self, chunk: Any) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...


class EngineDialect:
    """Base class of the engine dialects.

    Subclasses set `kind`, `weight_version_path` and implement `detects`, `read_model_info`, `chat`,
    `stream_call`, `abort_call` and `push_weights`; `versionless` and `model_info_paths` have defaults for an
    engine that has neither.
    """

    kind: ClassVar[str]
    # GET paths that answer the engine's description in SGLang's `/model_info` names, tried in order.
    model_info_paths: ClassVar[tuple[str, ...]] = ()
    weight_version_path: ClassVar[str]  # GET: `{"weight_version": …}`
    # An engine of this kind may serve no weight versions at all (its version path failing means None).
    versionless: ClassVar[bool] = False
    chat_path: ClassVar[str] = "/v1/chat/completions"

    @classmethod
    def detects(cls, model_info: Any, server_version: str | None) -> bool:
        """Is an engine of this kind what answered this (its `/model_info`, else vLLM's `/version`, or None)?"""
        raise NotImplementedError

    async def read_model_info(self, engine: AsyncEngine) -> dict[str, Any]:
        """The engine's description in SGLang's `/model_info` names (model and tokenizer paths, EOS ids, version,
        `logprobs_temperature_scaled`)."""
        raise NotImplementedError

    async def chat(self, engine: AsyncEngine, body: bytes) -> bytes:
        """A chat (or token-in) call answered whole: SGLang's answer as raw JSON bytes."""
        raise NotImplementedError

    async def stream_call(
        self, engine: AsyncEngine, body: bytes
    ) -> tuple[str, bytes, StreamTranslator | None]:
        """Where a `stream: true` call goes, its body, and the translator of its chunks (None: SGLang's already)."""
        raise NotImplementedError

    def abort_call(self, rid: str) -> tuple[str, dict[str, Any]]:
        """The POST (path, body) that stops generating our request `rid`."""
        raise NotImplementedError

    def push_weights(
        self, engine: BlockingEngine, model_dir: str | Path, *, weight_version: str | None, timeout: float
    ) -> PushReport:
        """Load the checkpoint in `model_dir` into the engine without waiting for the calls it is running; what was
        done (the weight_version it then serves, the pause running calls saw)."""
        raise NotImplementedError

    def read_weight_version(self, engine: BlockingEngine, *, timeout: float = 30.0) -> str | None:
        """The engine's current weight version, read now (blocking)."""
        return weight_version_of(engine.get_json(self.weight_version_path, timeout=timeout))


def weight_version_of(info: Any) -> str | None:
    """The `weight_version` of a `/model_info` answer, as text (None when it has none). Every reader of an engine's
    version — the gateway's per-call read (engines/client.py), the weight pushes — goes through this."""
    version = info.get("weight_version") if isinstance(info, dict) else None
    return None if version is None else str(version)


def next_version(versions: dict[str, str | None]) -> str | None:
    """The version to give every worker when none was asked for: one past the highest numeric one."""
    numbers = [int(v) for v in versions.values() if v is not None and v.isdigit()]
    return str(max(numbers) + 1) if numbers else None


def version_change(before: str | None, after: str | None) -> dict[str, Any]:
    """The meta fields saying a push landed during a call (`weight_version_after`), or nothing when none did."""
    if after is None or after == before:
        return {}
    return {"weight_version_after": after, "weight_version_changed": True}


async def offload(fn: Callable[..., T], size: int, *args: Any) -> T:
    """`fn(*args)` in a worker thread when its payload is large (long prompts' ids), inline otherwise."""
    if size < OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
