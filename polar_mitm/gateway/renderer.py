"""The engine's own chat template and tokenizer, loaded in the gateway, for token-exact prompts.

`polar_prompt_mode=tokens` builds each prompt as token ids (see `token_chains.py`): it renders the harness's
messages to *text* with the engine's chat template and tokenizes only the new tail of the conversation. That
is exact because every tail starts right after a special token (the end-of-turn that closes the previous
assistant turn), and Hugging Face tokenizers split the input at special tokens before running BPE, so a tail
tokenizes the same alone as inside the whole prompt. Whether this renderer equals the engine's is not assumed:
the gateway compares it with the engine's returned prompt ids on every chain's first call.

Loading takes seconds (transformers' import), so it runs once in a worker thread; nothing here touches the
event loop.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class RendererError(RuntimeError):
    """The engine's tokenizer cannot be loaded here (tokens mode then falls back to messages mode)."""


class PromptRenderer:
    """Renders engine chat requests to prompt text and encodes text to ids, like the engine does."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        from polar_mitm.reconstruct.prefix_merging import eot_from_tokenizer

        self.tokenizer = tokenizer
        self.source = source
        self.eot_id = eot_from_tokenizer(tokenizer)
        self.eot_text: str = tokenizer.convert_ids_to_tokens(self.eot_id)
        if self.eot_text not in tokenizer.all_special_tokens and self.eot_text not in getattr(
            tokenizer, "added_tokens_encoder", {}
        ):
            # The tail rule needs the end-of-turn to be an added (special) token: BPE never merges across it.
            raise RendererError(f"end-of-turn token {self.eot_text!r} is not a special token of {source}")

    @classmethod
    def load(cls, path: str) -> PromptRenderer:
        """The tokenizer (with its chat template) saved at `path`, offline."""
        if not Path(path).exists():
            raise RendererError(
                f"tokenizer path {path!r} does not exist on the gateway's machine "
                f"(set polar_tokenizer to a local copy of the engine's tokenizer)"
            )
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # a missing package or a broken folder: say which, then fall back
            raise RendererError(f"cannot load the tokenizer at {path!r}: {exc}") from exc
        if not getattr(tokenizer, "chat_template", None):
            raise RendererError(f"the tokenizer at {path!r} has no chat template")
        return cls(tokenizer, path)

    def render(self, request: dict[str, Any]) -> str:
        """The prompt text the engine renders for an engine chat request (generation prompt included)."""
        kwargs = request.get("chat_template_kwargs") or {}
        return self.tokenizer.apply_chat_template(
            request["messages"],
            tools=request.get("tools") or None,
            add_generation_prompt=True,
            tokenize=False,
            **kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens parsed, no BOS/EOS added (what apply_chat_template does)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


class RendererLoader:
    """Loads the renderer once, in a thread, from a path or from the engine's `/model_info` tokenizer path.

    A failed load is remembered with its reason (tokens mode then runs as messages mode, and records say why);
    `reset()` allows another try (e.g. when the engine comes up later than the gateway).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._future: Future | None = None

    def get(self, path_hint: str | None) -> Future:
        """A future of the PromptRenderer (or of its RendererError), started on first use."""
        with self._lock:
            if self._future is None:
                self._future = Future()
                threading.Thread(
                    target=self._load, args=(self._future, path_hint), name="polar-renderer", daemon=True
                ).start()
            return self._future

    def reset(self) -> None:
        with self._lock:
            self._future = None

    @staticmethod
    def _load(future: Future, path: str | None) -> None:
        try:
            if not path:
                raise RendererError("no tokenizer path (engine /model_info gave none; set polar_tokenizer)")
            renderer = PromptRenderer.load(path)
            log.info(
                "token-exact prompts: renderer loaded from %s (end-of-turn %r = %d)",
                path,
                renderer.eot_text,
                renderer.eot_id,
            )
            future.set_result(renderer)
        except Exception as exc:
            log.warning("token-exact prompts unavailable, using messages mode: %s", exc)
            future.set_exception(exc if isinstance(exc, RendererError) else RendererError(str(exc)))
