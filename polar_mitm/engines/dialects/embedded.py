"""The embedded engine's dialect (`polar-mitm serve`, polar_mitm/engine/): SGLang's API, which it copies.

It differs in how it is recognised — its `/model_info` names it (`engine: polar-mitm-embedded`) — and in how its
server takes a push (engine/server.py): a label it served before is refused, and a push without one gets one past
the current. The push sent is SGLang's (`POST /update_weights_from_disk`, always with a new label when the served
version is numeric), so that is inherited as it is, like everything else.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polar_mitm.engines.dialects.sglang import SGLangDialect

EMBEDDED_ENGINE_NAME = "polar-mitm-embedded"  # what `polar-mitm serve` answers in /model_info's `engine`


class EmbeddedDialect(SGLangDialect):
    kind: ClassVar[str] = "embedded"

    @classmethod
    def detects(cls, model_info: Any, server_version: str | None) -> bool:
        return isinstance(model_info, dict) and model_info.get("engine") == EMBEDDED_ENGINE_NAME
