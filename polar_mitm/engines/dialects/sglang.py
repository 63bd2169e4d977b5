"""SGLang's dialect: the gateway's own engine API, so calls and streams pass through as they are.

SGLang answers chat calls with the ids and logprobs the gateway asks for (`return_token_ids`, `return_meta_info`,
the sglext stream chunk), aborts by `rid` (`POST /abort_request`), says its weight version in `GET /model_info`,
and takes new weights with `POST /update_weights_from_disk` (the label in `weight_version`). Its logprobs are
log_softmax(logits / T) before top-p/top-k: every answer's meta info says so (`logprobs_temperature_scaled`), spliced
in as bytes rather than re-encoding the answer (a 30k-id answer costs ~1 ms to parse and write again).

A push under running calls (issue 43; written from SGLang 0.5's API, not run here — no GPU): SGLang's update either
waits for every running request or, with `abort_all_requests` (what RL stacks set, and some versions' default),
aborts them all. So the push pauses first — `POST /pause_generation {"mode": "retract"}`: running requests go back
to the queue, their KV cache freed, and are prefilled again under the new weights at `POST /continue_generation` —
updates with `abort_all_requests: false`, and continues. An SGLang without `/pause_generation` (404) is updated
with `abort_all_requests: true`: its calls end with finish `abort` and the gateway resumes each from its tokens so
far (gateway/live.py), so no push waits for the longest call. A pause whose `mode` the server does not know aborts
too (SGLang's pause default), and the gateway resumes those calls the same way.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

from polar_mitm.codecs.base import GatewayError
from polar_mitm.engines.dialects.base import (
    AsyncEngine,
    BlockingEngine,
    EngineDialect,
    EngineSyncError,
    PushReport,
    StreamTranslator,
    next_version,
)

SGLANG_META = b'"meta_info":{'
SGLANG_LOGPROBS_FIELD = b'"logprobs_temperature_scaled":true'


class SGLangDialect(EngineDialect):
    kind: ClassVar[str] = "sglang"
    model_info_paths: ClassVar[tuple[str, ...]] = (
        "/model_info",
        "/get_model_info",
    )  # the router: the older name
    weight_version_path: ClassVar[str] = "/model_info"
    push_path: ClassVar[str] = "/update_weights_from_disk"

    @classmethod
    def detects(cls, model_info: Any, server_version: str | None) -> bool:
        return isinstance(model_info, dict)

    async def read_model_info(self, engine: AsyncEngine) -> dict[str, Any]:
        info = await read_sglang_model_info(engine)
        info.setdefault("logprobs_temperature_scaled", True)
        return info

    async def chat(self, engine: AsyncEngine, body: bytes) -> bytes:
        return with_logprobs_meta(await engine.request("POST", self.chat_path, body))

    async def stream_call(
        self, engine: AsyncEngine, body: bytes
    ) -> tuple[str, bytes, StreamTranslator | None]:
        return self.chat_path, body, None

    def abort_call(self, rid: str) -> tuple[str, dict[str, Any]]:
        return "/abort_request", {"rid": rid}

    pause_path: ClassVar[str] = "/pause_generation"
    continue_path: ClassVar[str] = "/continue_generation"
    pause_mode: ClassVar[str] = "retract"  # requests kept, re-prefilled under the new weights at the continue

    def push_weights(
        self, engine: BlockingEngine, model_dir: str | Path, *, weight_version: str | None, timeout: float
    ) -> PushReport:
        """Pause (requests retracted), `POST /update_weights_from_disk`, continue; without a pause endpoint the
        update aborts the running calls and the gateway resumes them. `model_dir` must be readable by the engine
        at that path (same machine or a shared filesystem)."""
        started = time.perf_counter()
        paused = engine.post(self.pause_path, {"mode": self.pause_mode}, timeout=timeout)
        if paused.status_code == 404:  # an SGLang before /pause_generation: abort and let the gateway resume
            version, _ = self.update(engine, model_dir, weight_version, timeout, {"abort_all_requests": True})
            return PushReport(version, 0.0, "abort", time.perf_counter() - started)
        if paused.status_code != 200:
            raise EngineSyncError(
                f"{engine.url}{self.pause_path} refused: HTTP {paused.status_code} {paused.text[:500]}"
            )
        try:
            version, _ = self.update(
                engine, model_dir, weight_version, timeout, {"abort_all_requests": False}
            )
        finally:
            resumed = engine.post(self.continue_path, {}, timeout=timeout)
        pause = time.perf_counter() - started
        if resumed.status_code != 200:
            raise EngineSyncError(
                f"{engine.url}{self.continue_path} refused: HTTP {resumed.status_code} {resumed.text[:500]}"
            )
        return PushReport(version, pause, self.pause_mode, pause)

    def update(
        self,
        engine: BlockingEngine,
        model_dir: str | Path,
        weight_version: str | None,
        timeout: float,
        fields: dict[str, Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """`POST /update_weights_from_disk` (with `fields`); the version the engine then serves (its answer's, or
        read when the answer omits it) and its answer."""
        before = self.read_weight_version(engine)
        # Always a label: SGLang keeps the served one when none is given, and records would name the wrong weights.
        weight_version = weight_version or next_version({engine.url: before})
        body: dict[str, Any] = {"model_path": str(Path(model_dir).resolve()), **(fields or {})}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        response = engine.post(self.push_path, body, timeout=timeout)
        try:
            answer = response.json()
        except ValueError:
            answer = {"success": False, "message": response.text[:500]}
        if response.status_code != 200 or not answer.get("success"):
            raise EngineSyncError(
                f"{engine.url} refused the weights in {model_dir}: "
                f"HTTP {response.status_code} {answer.get('message', '')}"
            )
        # SGLang's answer may omit the version: ask for it.
        served = str(answer.get("weight_version") or self.read_weight_version(engine) or weight_version or "")
        if served == (before or ""):
            raise EngineSyncError(
                f"{engine.url} took {model_dir} but kept weight_version {served}: push a new label"
            )
        return served, answer


async def read_sglang_model_info(engine: AsyncEngine) -> dict[str, Any]:
    """`GET /model_info`, else the router's `/get_model_info` (GatewayError `overloaded` while the engine is down;
    another GatewayError when it answers neither)."""
    own_name, routers_name = SGLangDialect.model_info_paths
    try:
        info = await engine.get_json(own_name)
    except GatewayError as err:
        if err.kind == "overloaded":
            raise
        info = await engine.get_json(routers_name)
    if not isinstance(info, dict):
        raise GatewayError("engine_error", f"unexpected /model_info answer: {info!r:.200}")
    return info


def with_logprobs_meta(raw: bytes) -> bytes:
    """SGLang's answer with `logprobs_temperature_scaled: true` in its meta info, spliced in as bytes."""
    at = raw.find(SGLANG_META)
    if at < 0:
        return raw  # no meta info (not our request's answer): Completion parsing will say what is wrong
    cut = at + len(SGLANG_META)
    separator = b"" if raw[cut : cut + 1] == b"}" else b","
    return raw[:cut] + SGLANG_LOGPROBS_FIELD + separator + raw[cut:]
