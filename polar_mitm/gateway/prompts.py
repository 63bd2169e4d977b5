"""How a call's prompt reaches the engine: `tokens` (token-exact, the default) or `messages` (the engine renders).

`messages`: the engine renders the harness's messages with its chat template — what every gateway does, and
what drifts from the sampled tokens when a harness rewrites its history. `tokens`: the gateway sends the exact
token stream of the session's chain plus the new tail (`token_chains.py`), so every sampled token is trained in
the very context it was sampled in. Tokens mode needs the engine's tokenizer here; when it cannot be loaded,
or disagrees with the engine's own rendering, calls go in messages mode and the records say why.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, get_args

import orjson

from polar_mitm.conversation import Completion, Conversation
from polar_mitm.gateway.incremental_render import RenderedTip
from polar_mitm.gateway.options import PromptMode
from polar_mitm.gateway.renderer import PromptRenderer, RendererError, RendererLoader
from polar_mitm.gateway.token_chains import NO_CHAIN, RENDERER_MISMATCH, Plan, TokenChains

log = logging.getLogger(__name__)

PROMPT_MODES = get_args(PromptMode)  # the one set: gateway/options.py


@dataclass
class PromptStep:
    """What was decided for one call; recorded as prompt_mode / spliced_turns / splice_reason."""

    mode: str  # tokens | messages: who built the prompt ids the engine used
    plan: Plan | None = None
    spliced_turns: int | None = None  # see Plan.spliced_turns; None in messages mode
    reason: str | None = None
    check_ids: asyncio.Future | None = None  # our own rendering of a chain's first prompt, to compare
    input_ids_json: bytes | None = None  # tokens mode: the input_ids as the request body holds them

    def sent_ids(self) -> tuple[list[int] | None, bytes | None]:
        """The input_ids sent and their JSON bytes (None, None in messages mode): the engine's echo is compared
        with these bytes (`Completion.from_engine_answer`)."""
        if self.plan is None or self.plan.input_ids is None:
            return None, None
        return self.plan.input_ids, self.input_ids_json


class PromptBuilder:
    """Builds each engine request's prompt per `mode`; keeps the session chains of tokens mode."""

    def __init__(
        self,
        mode: str = "tokens",
        *,
        tokenizer: str = "",
        model_info=None,
        max_chain_tokens: int = 64 << 20,
        incremental: bool = True,
    ) -> None:
        if mode not in PROMPT_MODES:
            raise ValueError(f"polar_prompt_mode must be one of {PROMPT_MODES}, got {mode!r}")
        self.mode = mode
        self.tokenizer_hint = tokenizer
        self.model_info = model_info  # async () -> dict: the engine's /model_info (for its tokenizer path)
        self.max_chain_tokens = max_chain_tokens
        # Render only the messages a call adds to its chain's tip where that is proved exact (False: always the
        # full render, which bench_token_exact compares against).
        self.incremental = incremental
        self._loader = RendererLoader()
        self._chains: TokenChains | None = None
        self._unavailable: str | None = None
        self._loaded: PromptRenderer | None = None
        self._engine_error: str | None = None  # /model_info failed on the last try (no tokenizer path yet)

    async def _renderer(self) -> PromptRenderer | None:
        if self._loaded is not None:
            return self._loaded  # loaded for good: no /model_info or future hop per call
        if self._unavailable is not None:
            return None
        path = self.tokenizer_hint
        if not path and self.model_info is not None:
            try:
                path = (await self.model_info()).get("tokenizer_path") or ""
                self._engine_error = None
            except Exception as exc:  # the engine is down: messages mode now, try again next call
                log.debug("no /model_info yet: %s", exc)
                self._engine_error = str(exc) or type(exc).__name__
                return None
        try:
            renderer = await asyncio.wrap_future(self._loader.get(path))
        except RendererError as exc:
            self._unavailable = str(exc)
            return None
        if self._chains is None:
            self._chains = TokenChains(renderer.eot_id, renderer.eot_text, max_tokens=self.max_chain_tokens)
        self._loaded = renderer
        return renderer

    async def warm(self) -> PromptRenderer | None:
        """Load the engine's tokenizer now (tokens mode) instead of on the first call; None when not available."""
        return await self._renderer() if self.mode == "tokens" else None

    @property
    def engine_error(self) -> str | None:
        """Why the engine's /model_info failed on the last try (None: it answered, or was not asked)."""
        return self._engine_error

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): ready once no call would wait for a load — the renderer loaded, known unavailable
        (messages mode), or the engine not answering yet (calls go in messages mode until it does)."""
        if self.mode == "messages":
            return True, "messages mode"
        if self._loaded is not None:
            return True, f"tokens mode, renderer from {self._loaded.source}"
        if self._unavailable is not None:
            return True, f"messages mode: tokens mode unavailable: {self._unavailable}"
        if self._engine_error is not None:
            return (
                True,
                f"engine not answering /model_info yet ({self._engine_error}): messages mode until it does",
            )
        return False, "loading the engine's tokenizer and chat template"

    async def prepare(
        self,
        session_id: str,
        conv: Conversation,
        request: dict[str, Any],
        call_kind: str | None = None,
        *,
        inline: bool = False,
    ) -> tuple[PromptStep, bytes]:
        """Decide the prompt of one call; returns the step and the engine request body (JSON bytes).

        `call_kind` (the record's): a compaction's commit marks the session; the next main call that opens a chain
        is recorded as its consequence (reconstruct/compaction_label.py). `inline` (a small call, by the caller's
        offload policy): an incremental rendering is planned on the event loop, where a thread hop would cost more
        than the work; a full rendering always runs in a thread.
        """
        if self.mode == "messages":
            return PromptStep(mode="messages"), await _dumps(request)
        renderer = await self._renderer()
        if renderer is None or self._chains is None:
            reason = f"tokens mode unavailable: {self._unavailable or 'engine tokenizer not loaded yet'}"
            return PromptStep(mode="messages", reason=reason), await _dumps(request)
        chains = self._chains
        if not chains.routable(session_id):
            return await self._prepare_unrouted(renderer, chains, session_id, conv, request, call_kind)

        def incremental() -> RenderedTip | None:
            return renderer.render_after_tip(request, chains.tips(session_id)) if self.incremental else None

        def plan_and_dump(rendered: RenderedTip | None) -> tuple[Plan, bytes, bytes | None]:
            if rendered is None:
                rendered = rendered_tip(request, renderer.render(request))
            plan = chains.plan(session_id, rendered.text, conv.messages, renderer.encode, call_kind)
            plan.rendered = rendered
            if plan.input_ids is None:
                return plan, orjson.dumps(request), None
            return (plan, *with_input_ids(request, plan.input_ids))

        rendered = incremental() if inline else None
        if rendered is not None:
            plan, body, ids_json = plan_and_dump(rendered)
        else:
            plan, body, ids_json = await asyncio.to_thread(
                lambda: plan_and_dump(None if inline else incremental())
            )
        step = PromptStep(
            mode="tokens" if plan.input_ids is not None else "messages",
            plan=plan,
            spliced_turns=plan.spliced_turns,
            reason=plan.reason,
            input_ids_json=ids_json,
        )
        if plan.input_ids is None:
            # A chain's first call: the engine renders; our rendering must agree before any splice builds on it.
            step.check_ids = asyncio.ensure_future(asyncio.to_thread(renderer.encode, plan.text))
        return step, body

    async def _prepare_unrouted(
        self,
        renderer: PromptRenderer,
        chains: TokenChains,
        session_id: str,
        conv: Conversation,
        request: dict[str, Any],
        call_kind: str | None,
    ) -> tuple[PromptStep, bytes]:
        """A session with no chain to extend (its first call) or in messages mode for good: the engine renders,
        so nothing of ours comes before the engine request. A first call's own rendering — the chain's tip, and
        the check that it agrees with the engine's — runs alongside the engine call."""
        plan = chains.unrouted_plan(session_id, len(conv.messages), call_kind)
        step = PromptStep(mode="messages", plan=plan, spliced_turns=plan.spliced_turns, reason=plan.reason)
        if plan.spliced_turns is not None:  # not a session in messages mode for good

            def render_and_encode() -> list[int]:
                plan.text = renderer.render(request)
                plan.rendered = rendered_tip(request, plan.text)
                return renderer.encode(plan.text)

            step.check_ids = asyncio.ensure_future(asyncio.to_thread(render_and_encode))
        return step, await _dumps(request)

    async def _checked(self, step: PromptStep) -> list[int] | None:
        """Our rendering of a chain's first prompt, or None when it failed (the session then stays unspliced)."""
        assert step.check_ids is not None and step.plan is not None
        try:
            return await step.check_ids
        except Exception as exc:  # a template that cannot render this conversation: never splice on it
            log.warning("session %s: the gateway cannot render this prompt (%s)", step.plan.session_id, exc)
            return None

    async def complete(self, step: PromptStep, completion: Completion) -> None:
        """After a successful engine call: verify the renderer on new chains, then advance the chains."""
        if step.plan is None or self._chains is None:
            return
        if step.check_ids is not None:
            ours = await self._checked(step)
            if ours != completion.prompt_ids:
                log.warning(
                    "session %s: the gateway's rendering (%s ids) differs from the engine's (%d ids); "
                    "messages mode for this session",
                    step.plan.session_id,
                    "no" if ours is None else len(ours),
                    len(completion.prompt_ids),
                )
                self._chains.fall_back(step.plan.session_id)
                step.reason, step.spliced_turns = RENDERER_MISMATCH, 0
                return
        elif completion.prompt_ids != step.plan.input_ids:
            log.warning(
                "session %s: the engine's prompt ids differ from the input_ids sent; chain not extended",
                step.plan.session_id,
            )
            return
        # Inline: committing copies one list and takes the chain lock briefly; a thread hop costs more.
        self._chains.commit(step.plan, completion)

    def abandon(self, step: PromptStep) -> None:
        """The engine call failed: nothing to commit; stop a pending rendering check."""
        if step.check_ids is not None:
            step.check_ids.cancel()

    def stats(self) -> dict[str, int]:
        return self._chains.stats() if self._chains is not None else {}


def with_input_ids(request: dict[str, Any], input_ids: list[int]) -> tuple[bytes, bytes]:
    """The engine request body with `input_ids` (messages stay: the engine's parsers still need them), and the ids'
    own JSON bytes, the slice of the body the engine's echo is compared with."""
    request.pop("input_ids", None)
    head, ids_json = orjson.dumps(request), orjson.dumps(input_ids)
    request["input_ids"] = input_ids
    return head[:-1] + (b',"input_ids":' if len(head) > 2 else b'"input_ids":') + ids_json + b"}", ids_json


def rendered_tip(request: dict[str, Any], text: str) -> RenderedTip:
    """What `text` was rendered from; the messages list is copied (a later change to the request's list must not
    change what a chain tip claims it rendered)."""
    return RenderedTip(
        list(request["messages"]),
        request.get("tools") or None,
        request.get("chat_template_kwargs") or {},
        text,
    )


async def _dumps(request: dict[str, Any]) -> bytes:
    # Messages of a long session are large: serialise them off the event loop.
    if len(request.get("messages") or ()) < 32:
        return orjson.dumps(request)
    return await asyncio.to_thread(orjson.dumps, request)


__all__ = ["NO_CHAIN", "PROMPT_MODES", "PromptBuilder", "PromptStep"]
