"""The embedded engine's dialect (`polar-mitm serve`, polar_mitm/engine/): SGLang's API, which it copies.

It differs in how it is recognised — its `/model_info` names it (`engine: polar-mitm-embedded`) — and in how its
server takes a push (engine/server.py): a label it served before is refused, and a push without one gets one past
the current. The push sent is SGLang's update (`POST /update_weights_from_disk`, always with a new label when the
served version is numeric) without SGLang's pause around it: the engine lands the new weights between two tokens
of the running call itself (or aborts it, `polar-mitm serve --on-push abort`), and says the stall that cost.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

from polar_mitm.engines.dialects.base import BlockingEngine, PushReport
from polar_mitm.engines.dialects.sglang import SGLangDialect

EMBEDDED_ENGINE_NAME = "polar-mitm-embedded"  # what `polar-mitm serve` answers in /model_info's `engine`


class EmbeddedDialect(SGLangDialect):
    kind: ClassVar[str] = "embedded"

    @classmethod
    def detects(cls, model_info: Any, server_version: str | None) -> bool:
        return isinstance(model_info, dict) and model_info.get("engine") == EMBEDDED_ENGINE_NAME

    def push_weights(
        self, engine: BlockingEngine, model_dir: str | Path, *, weight_version: str | None, timeout: float
    ) -> PushReport:
        """The update alone; the engine's answer says how the running call took it (`on_push`) and its stall."""
        started = time.perf_counter()
        version, answer = self.update(engine, model_dir, weight_version, timeout)
        return PushReport(
            version,
            float(answer.get("pause_seconds") or 0.0),
            str(answer.get("on_push") or "swap"),
            time.perf_counter() - started,
        )
