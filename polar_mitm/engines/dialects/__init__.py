"""Engine dialects: one class per engine kind behind one interface (`base.EngineDialect`), picked once by this
registry.

SGLang's API is the gateway's own (`sglang.py`); the embedded engine speaks it too and differs only in how it is
recognised (`embedded.py`); vLLM's calls, answers, streams and weight pushes are translated (`vllm.py`). The engine
client, the weight pushes and the gateway's options ask the registry, never a kind by name: which kinds there are
(`ENGINE_KINDS`, what `polar_engine` accepts), which dialect an engine speaks (`engine_kind` from what it answered,
`detect` asking it), and where any kind answers its description (`DESCRIPTION_PATHS`).
"""

from __future__ import annotations

import logging
from typing import Any

from polar_mitm.codecs.base import GatewayError
from polar_mitm.engines.dialects.base import AsyncEngine, EngineDialect
from polar_mitm.engines.dialects.embedded import EmbeddedDialect
from polar_mitm.engines.dialects.sglang import SGLangDialect, read_sglang_model_info
from polar_mitm.engines.dialects.vllm import VllmDialect

log = logging.getLogger(__name__)

DIALECTS: dict[str, EngineDialect] = {
    dialect.kind: dialect for dialect in (SGLangDialect(), VllmDialect(), EmbeddedDialect())
}
ENGINE_KINDS: tuple[str, ...] = tuple(DIALECTS)  # the one declaration of the kinds (gateway options read it)
# SGLang's dialect is the gateway's own: what an engine that says nothing about itself is spoken to in.
DEFAULT_DIALECT: EngineDialect = DIALECTS["sglang"]
# Who answered is read most specific first: the embedded engine's model info names it, any other is SGLang's.
DETECTION_ORDER: tuple[EngineDialect, ...] = (DIALECTS["embedded"], DIALECTS["sglang"], DIALECTS["vllm"])
# What kind detection asks: SGLang's model info (SGLang and the embedded engine answer it), else vLLM's version.
MODEL_INFO_PATH = SGLangDialect.model_info_paths[0]
SERVER_VERSION_PATH = VllmDialect.server_version_path
# Every GET that answers some kind's description or weight version in `/model_info`'s names, in the order to try.
DESCRIPTION_PATHS: tuple[str, ...] = tuple(
    dict.fromkeys(
        path
        for dialect in DIALECTS.values()
        for path in (*dialect.model_info_paths, dialect.weight_version_path)
    )
)

__all__ = [
    "DEFAULT_DIALECT",
    "DESCRIPTION_PATHS",
    "DIALECTS",
    "ENGINE_KINDS",
    "EngineDialect",
    "MODEL_INFO_PATH",
    "SERVER_VERSION_PATH",
    "detect",
    "engine_kind",
]


def engine_kind(model_info: Any, server_version: str | None) -> str:
    """The engine's kind from what it answered: `/model_info` (SGLang, the embedded engine) or `/version` (vLLM)."""
    for dialect in DETECTION_ORDER:
        if dialect.detects(model_info, server_version):
            return dialect.kind
    raise ValueError("the engine answers neither /model_info (SGLang) nor /version (vLLM)")


async def detect(engine: AsyncEngine) -> EngineDialect:
    """Ask the engine which dialect it speaks (GatewayError `overloaded` while it is down: nothing was learnt).

    An engine that answers neither question only serves chat: it is spoken to in SGLang's dialect."""
    info: dict[str, Any] | None = None
    version: str | None = None
    try:
        info = await read_sglang_model_info(engine)
    except GatewayError as err:
        if err.kind == "overloaded":
            raise
        try:
            version = str((await engine.get_json(SERVER_VERSION_PATH)).get("version"))
        except (GatewayError, AttributeError):
            version = None
    try:
        return DIALECTS[engine_kind(info, version)]
    except ValueError as exc:
        log.warning("%s: %s; speaking SGLang's API to it", engine.base_url, exc)
        return DEFAULT_DIALECT
