"""The engine's own chat template and tokenizer, loaded in the gateway, for token-exact prompts.

`polar_prompt_mode=tokens` builds each prompt as token ids (see `token_chains.py`): it renders the harness's
messages to *text* with the engine's chat template and tokenizes only the new tail of the conversation. That
is exact because every tail starts right after a special token (the end-of-turn that closes the previous
assistant turn), and Hugging Face tokenizers split the input at special tokens before running BPE, so a tail
tokenizes the same alone as inside the whole prompt. Whether this renderer equals the engine's is not assumed:
the gateway compares it with the engine's returned prompt ids on every chain's first call. A call that extends a
chain's tip renders only the messages it adds, for the templates where `incremental_render.py` proves that equal
to the full render (`render_after_tip`); any other call is rendered in full.

The gateway loads it while it starts (the readiness answer waits for it), so it must load fast, and it tokenizes a
tail on every call, so that must be fast too: a folder with a `tokenizer.json` is tokenized by tiktoken when
`gateway/bpe.py` finds it reproduces that tokenizer exactly (else by the `tokenizers` library), and its template is
compiled with jinja2 in the environment transformers' `apply_chat_template` uses — no transformers import, which
alone takes 2–5 s. A folder without one (a slow, Python-only tokenizer) is loaded with transformers. Nothing here
touches the event loop.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import datetime
from pathlib import Path
from typing import Any

from polar_mitm.gateway import incremental_render
from polar_mitm.gateway.incremental_render import RenderedTip

log = logging.getLogger(__name__)


class RendererError(RuntimeError):
    """The engine's tokenizer cannot be loaded here (tokens mode then falls back to messages mode)."""


SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
WARM_UP_REQUEST = {"messages": [{"role": "user", "content": "Hello."}]}
REASONING_FIELDS = (
    "reasoning_content",
    "thinking",
    "reasoning",
)  # as transformers aliases them for templates


class PromptRenderer:
    """Renders engine chat requests to prompt text and encodes text to ids, like the engine does.

    `render_messages` and `encode` are the two hot-path operations; subclasses supply them.
    """

    source: str
    eot_id: int
    eot_text: str

    def _set_eot(self, token_id: Callable[[str], int | None], eos_token: str | None, added: set[str]) -> None:
        from polar_mitm.reconstruct.prefix_merging import KNOWN_EOT_TOKENS

        eot_text = next((text for text in KNOWN_EOT_TOKENS if token_id(text) is not None), eos_token)
        eot_id = token_id(eot_text) if eot_text is not None else None
        if eot_text is None or eot_id is None:
            raise RendererError(f"the tokenizer at {self.source!r} has no end-of-turn or EOS token")
        if eot_text not in added:
            # The tail rule needs the end-of-turn to be an added (special) token: BPE never merges across it.
            raise RendererError(f"end-of-turn token {eot_text!r} is not a special token of {self.source}")
        self.eot_text, self.eot_id = eot_text, int(eot_id)

    @classmethod
    def load(cls, path: str) -> PromptRenderer:
        """The tokenizer (with its chat template) saved at `path`, offline."""
        folder = Path(path)
        if not folder.exists():
            raise RendererError(
                f"tokenizer path {path!r} does not exist on the gateway's machine "
                f"(set polar_tokenizer to a local copy of the engine's tokenizer)"
            )
        if (folder / "tokenizer.json").exists():
            return FastRenderer.load(folder)
        return TransformersRenderer.load(folder)

    def render(self, request: dict[str, Any]) -> str:
        """The prompt text the engine renders for an engine chat request (generation prompt included)."""
        return self.render_messages(
            request["messages"], request.get("tools") or None, request.get("chat_template_kwargs") or {}
        )

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list | None,
        kwargs: dict[str, Any],
        add_generation_prompt: bool = True,
    ) -> str:
        raise NotImplementedError

    def render_after_tip(self, request: dict[str, Any], tips: Sequence[RenderedTip]) -> RenderedTip | None:
        """`render(request)` (as the tip it makes) built from a chain tip's text plus the new messages alone, where
        that is proved equal (gateway/incremental_render.py); None: render in full."""
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens parsed, no BOS/EOS added (what apply_chat_template does)."""
        raise NotImplementedError


class FastRenderer(PromptRenderer):
    """`tokenizer.json` through tiktoken where that is exact (gateway/bpe.py), else through the `tokenizers`
    library; the template through jinja2 as transformers runs it."""

    def __init__(
        self,
        encoder: Any,
        templates: dict[str, Any],
        special_tokens: dict[str, str],
        source: str,
        local: frozenset[str] = frozenset(),
    ) -> None:
        self.encoder, self.templates, self.special_tokens = encoder, templates, special_tokens
        self.source = source
        self.local = local  # names of the templates incremental rendering is proved for
        self._set_eot(encoder.token_id, special_tokens.get("eos_token"), set(encoder.added))

    @classmethod
    def load(cls, folder: Path) -> FastRenderer:
        try:
            encoder = load_encoder(folder / "tokenizer.json")
            config = _read_json(folder / "tokenizer_config.json")
            special_tokens = {**_special_tokens(_read_json(folder / "special_tokens_map.json"))}
            special_tokens.update(_special_tokens(config))
            texts = _templates(folder, config)
            templates = {name: compile_template(text) for name, text in texts.items()}
            local = frozenset(name for name, text in texts.items() if incremental_render.is_local(text))
        except RendererError:
            raise
        except Exception as exc:  # a broken folder or template: say which, then fall back
            raise RendererError(f"cannot load the tokenizer at {str(folder)!r}: {exc}") from exc
        if not templates:
            raise RendererError(f"the tokenizer at {str(folder)!r} has no chat template")
        return cls(encoder, templates, special_tokens, str(folder), local)

    def encode(self, text: str) -> list[int]:
        return self.encoder.encode(text)

    def _template_name(self, tools: list | None) -> str:
        # transformers picks the named "tool_use" template when tools are given and it exists, else "default".
        name = "tool_use" if tools and "tool_use" in self.templates else "default"
        return name if name in self.templates else next(iter(self.templates))

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list | None,
        kwargs: dict[str, Any],
        add_generation_prompt: bool = True,
    ) -> str:
        return self.templates[self._template_name(tools)].render(
            messages=template_messages(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )

    def render_after_tip(self, request: dict[str, Any], tips: Sequence[RenderedTip]) -> RenderedTip | None:
        tools, kwargs = request.get("tools") or None, request.get("chat_template_kwargs") or {}
        if not tips or self._template_name(tools) not in self.local:
            return None
        return incremental_render.render_after_tip(
            request["messages"],
            tools,
            kwargs,
            tips,
            lambda messages, prompt: self.render_messages(messages, tools, kwargs, prompt),
        )


class TokenizersEncoder:
    """A tokenizer.json run by the `tokenizers` library (any shape it supports)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(path))
        self.added = {token.content for token in self.backend.get_added_tokens_decoder().values()}
        self.token_id = self.backend.token_to_id

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: it releases the GIL while Rust tokenizes (a 3k-token tail takes milliseconds),
        # so the event loop serves every other session's call meanwhile; `encode` holds it throughout.
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids


def load_encoder(path: Path, cache: Path | None = None) -> Any:
    """tiktoken for a tokenizer.json it reproduces exactly (gateway/bpe.py), else the `tokenizers` library.
    tiktoken's tables are kept in `cache` (storage/bpe_cache.py; default: the model cache's `bpe/`), so the next
    gateway on the same tokenizer loads them instead of building them."""
    import orjson

    from polar_mitm.engine.model_zoo import cache_root
    from polar_mitm.gateway.bpe import TiktokenBPE, tables_of, unsupported
    from polar_mitm.storage import bpe_cache

    cache = cache_root() / "bpe" if cache is None else cache
    raw = path.read_bytes()
    kept = bpe_cache.load(cache, raw)
    if kept is not None:
        try:
            return TiktokenBPE(kept)
        except (ImportError, ValueError) as exc:
            log.debug("kept tables for %s unusable (%s): rebuilding", path, exc)
    data = orjson.loads(raw)
    why = unsupported(data)
    if why is None:
        try:
            tables = tables_of(data)
            encoder = TiktokenBPE(tables)
        except (ImportError, ValueError) as exc:
            why = str(exc)
        else:
            bpe_cache.save(cache, raw, tables)
            return encoder
    log.info("tokenizing with the tokenizers library (tiktoken cannot reproduce %s: %s)", path, why)
    return TokenizersEncoder(path)


class TransformersRenderer(PromptRenderer):
    """A tokenizer only transformers can load (no `tokenizer.json`): its own `apply_chat_template`."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        self.tokenizer, self.source = tokenizer, source
        added = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {}))
        vocab = tokenizer.get_vocab()
        self._set_eot(vocab.get, tokenizer.eos_token, added)

    @classmethod
    def load(cls, folder: Path) -> TransformersRenderer:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # a missing package or a broken folder: say which, then fall back
            raise RendererError(f"cannot load the tokenizer at {str(folder)!r}: {exc}") from exc
        if not getattr(tokenizer, "chat_template", None):
            raise RendererError(f"the tokenizer at {str(folder)!r} has no chat template")
        return cls(tokenizer, str(folder))

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list | None,
        kwargs: dict[str, Any],
        add_generation_prompt: bool = True,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: None-valued keys dropped, reasoning under its aliases."""
    shaped = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        shaped.append(message)
    return shaped


def compile_template(text: str) -> Any:
    """A chat template compiled in the sandboxed jinja2 environment transformers 5 renders it in."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        # `{% generation %}…{% endgeneration %}` marks assistant text for masks; rendering keeps its body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=dict,
        namespace=jinja2.utils.Namespace,
    )
    return env.from_string(text)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The named special tokens of a tokenizer config (a token may be saved as text or as an AddedToken dict)."""
    found = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def _templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """The chat templates of a tokenizer folder by name, as transformers finds them (files first)."""
    templates: dict[str, str] = {}
    template_file = folder / "chat_template.jinja"
    if template_file.exists():
        templates["default"] = template_file.read_text()
    for extra in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text()
    if templates:
        return templates
    saved = config.get("chat_template")
    if isinstance(saved, str):
        return {"default": saved}
    if isinstance(saved, list):  # named templates: [{"name": ..., "template": ...}]
        return {entry["name"]: entry["template"] for entry in saved}
    json_template = folder / "chat_template.json"
    if json_template.exists():
        return {"default": json.loads(json_template.read_text())["chat_template"]}
    return {}


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
            warm_up(renderer)
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


def warm_up(renderer: PromptRenderer) -> None:
    """Pay first-use costs (the tokenizer's caches, the template's first run) here rather than on a call."""
    try:
        renderer.encode(renderer.render(WARM_UP_REQUEST))
    except Exception as exc:  # a template may refuse this conversation; the calls' own are what count
        log.debug("renderer warm-up skipped: %s", exc)
