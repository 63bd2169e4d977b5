"""What a model call needs from the gateway, whether it is answered whole (service.py) or live (live.py): the
engine, the sessions' prompt chains, and the durable record. Both paths fill the record with `fill_record`, so their
records cannot drift apart.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from polar_mitm.conversation import Completion, Conversation
from polar_mitm.engines.client import EngineClient
from polar_mitm.engines.greedy import GREEDY_TEMPERATURE
from polar_mitm.gateway.prompts import PromptBuilder, PromptStep
from polar_mitm.storage.journal import RecordWriter
from polar_mitm.storage.records import Record

OFFLOAD_BYTES = (
    256 << 10
)  # below this (~40k ids), inline: the work (~1 ms) holds the GIL in a thread too, and a hop costs ~0.2 ms
ID_BYTES = 4  # a token id's share of a payload's size (records store ids as int32)


@dataclass
class CallContext:
    """The gateway's shared parts a model call uses."""

    engine: EngineClient
    prompts: PromptBuilder
    writer: RecordWriter

    def abandon(self, step: PromptStep | None) -> None:
        """The call failed after its prompt was planned: no chain moves; stop a pending rendering check."""
        if step is not None:
            self.prompts.abandon(step)

    async def persist(self, record: Record) -> dict[str, Any]:
        """Append the record durably; return its journal row."""
        record.finished_at = datetime.now(UTC)
        row = record.to_journal()
        # Durable before the harness gets its answer: the writer resolves the future after fsync.
        await asyncio.wrap_future(self.writer.write(row))
        return row


def fill_record(
    record: Record, conv: Conversation, completion: Completion, response: str | None, status: int
) -> None:
    """A finished call's record: what the engine did (ids, logprobs, finish, sampling) and the answer sent."""
    record.model_used = completion.model
    record.prompt_ids, record.completion_ids = completion.prompt_ids, completion.completion_ids
    record.completion_logprobs = completion.completion_logprobs
    record.prompt_tokens, record.completion_tokens = completion.prompt_tokens, completion.completion_tokens
    record.finish_reason, record.weight_version = completion.finish_reason, completion.weight_version
    record.version_spans = version_spans(
        completion.meta_info.get("version_spans"), len(completion.completion_ids)
    )
    record.response_json = response
    record.engine_meta_json = completion.meta_json
    record.temperature, record.top_p = conv.sampling["temperature"], conv.sampling["top_p"]
    record.top_k, record.min_p = conv.sampling["top_k"], conv.sampling["min_p"]
    record.greedy = is_greedy(conv.sampling)
    record.status_code = status


def version_spans(spans: Any, n_sampled: int) -> list[dict[str, Any]] | None:
    """The engine's version spans (where a push landed between two sampled tokens) as the record's column: the
    first at 0, starts increasing within the completion; None when the engine said none or said them wrong (the
    record then reads as one span of its weight_version)."""
    if not isinstance(spans, list) or not spans:
        return None
    kept: list[dict[str, Any]] = []
    for span in spans:
        if not isinstance(span, dict) or type(span.get("start")) is not int or span.get("version") is None:
            return None
        start = span["start"]
        if (
            (kept and start <= kept[-1]["start"])
            or (not kept and start != 0)
            or start > max(n_sampled - 1, 0)
        ):
            return None
        kept.append({"start": start, "version": str(span["version"])})
    return kept


async def offload(fn, size: int, *args):
    """Run `fn` in a worker thread when its payload (`size` bytes; ids count `ID_BYTES` each) is large, so big
    prompts never stall the event loop."""
    if size < OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def is_greedy(sampling: dict[str, Any]) -> bool:
    try:
        return float(sampling["temperature"]) < GREEDY_TEMPERATURE or int(sampling["top_k"]) == 1
    except (TypeError, ValueError):
        return False
