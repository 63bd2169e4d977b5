"""The gateway's options, and the running core built from them (the first addon: everything after it reads the core).

Options are declared once, in `GatewayOptions` (gateway/options.py): `load` adds them, `configure` parses them all
into one before applying any (mitmproxy's option contract, see `mitmproxy/addons/blocklist.py`), and they are set
with `--set name=value`. A gateway that cannot run as configured stops before it serves anything.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from mitmproxy import ctx
from mitmproxy.exceptions import OptionsError

from polar_mitm.engines import keys as engine_keys
from polar_mitm.engines.client import EngineClient
from polar_mitm.engines.description import record_engine
from polar_mitm.gateway import log_redaction
from polar_mitm.gateway.addons.core import GatewayCore
from polar_mitm.gateway.exposure import exposure_warning
from polar_mitm.gateway.options import (
    PREFIX,
    STARTUP_ONLY,
    GatewayOptions,
    OptionError,
    mitmproxy_options,
    parse_options,
)
from polar_mitm.gateway.prompts import PromptBuilder
from polar_mitm.gateway.service import Gateway
from polar_mitm.storage.journal import RecordWriter
from polar_mitm.storage.records import last_seq_by_session

log = logging.getLogger(__name__)

STARTED = time.monotonic()  # the addon's import: the gateway process has just started

WRITER_OPTIONS = (
    "out",
    "rotate_mb",
    "rotate_seconds",
    "fsync",
)  # GatewayOptions fields the writer is made from
ENGINE_OPTIONS = ("backend", "engine", "engine_timeout", "tool_call_parser")
PROMPT_OPTIONS = ("prompt_mode", "tokenizer", "backend", "engine", "tool_call_parser")


def stop_process(message: str) -> NoReturn:
    """The addon cannot run as configured: one line on stderr, and the proxy stops before it serves anything.

    A SystemExit, not an exception mitmproxy would log and carry on past: a proxy whose addon is not in charge
    forwards every request to the real provider (fail open).
    """
    print(f"polar-mitm: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_deferred_options(options: Any) -> None:
    """Apply the `--set polar_…` values mitmproxy deferred until our options exist, or stop the process.

    mitmproxy applies them right after `load`, in the script loader's task, where an error (an option given
    twice, a value that is not an int) is lost: the addon is then registered but never called, and the proxy
    forwards everything upstream. Applying them here, with mitmproxy's own parser, turns that into a stop.
    """
    # `polar-out` too: mitmproxy would keep a dashed name deferred for ever and the gateway write to the default
    ours = {
        name: value
        for name, value in options.deferred.items()
        if name.replace("-", "_").lower().startswith(PREFIX)
    }
    for name in ours:
        del options.deferred[name]
    for name, value in ours.items():
        if name not in options:
            stop_process(
                f"unknown option {name}{_likely_option(name, options)} (see README's gateway options)"
            )
        texts = deferred_texts(value)
        try:
            if texts is None:  # deferred as a value (an options file, Python), not as `--set` text
                options.update(**{name: value})
            else:  # `options.set` is what `--set` and the `set` command use: mitmproxy's parser, then update
                options.set(*([f"{name}={text}" for text in texts] or [name]))
        except OptionsError as exc:
            if texts is not None and len(texts) > 1:
                stop_process(f"{name} is set {len(texts)} times ({', '.join(map(repr, texts))}); set it once")
            shown = value if texts is None else (texts[0] if texts else "")
            stop_process(f"cannot apply --set {name}={shown}: {exc}")


def _likely_option(name: str, options: Any) -> str:
    ours = [known for known in options.keys() if known.startswith(PREFIX)]
    likely = difflib.get_close_matches(name.replace("-", "_").lower(), ours, n=1, cutoff=0.6)
    return f": did you mean {likely[0]}?" if likely else ""


def deferred_texts(value: Any) -> list[str] | None:
    """The `--set` texts of a deferred option; None when it was deferred as a value.

    The one place that knows how mitmproxy keeps deferred `--set` texts: an object with the texts as `val`
    (optmanager's `_UnconvertedStrings`), which mitmproxy exposes no public name for.
    """
    texts = getattr(value, "val", None)
    return list(texts) if isinstance(texts, list) else None


class Configuration:
    """Declares the gateway's options, builds the running core from them, and starts it."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self._warm_task: asyncio.Task | None = None  # loads the renderer while the gateway starts

    def load(self, loader) -> None:
        for option in mitmproxy_options():
            loader.add_option(
                option.name,
                option.typespec,
                option.default,
                option.help,
                choices=list(option.choices) if option.choices else None,
            )
        check_deferred_options(loader.master.options)
        log_redaction.install()

    # -- parse and check everything first, then apply (mitmproxy's option contract) ----------------------------

    def configure(self, updated: set[str]) -> None:
        """Parse every option into `GatewayOptions` and build what changed, raising OptionsError before anything
        is replaced (mitmproxy then rolls the change back, and calls this again with the old values, which changes
        nothing); at startup, when there is nothing to roll back to, a bad option stops the process instead."""
        core = self.core
        try:
            options = parse_options(ctx.options)
        except OptionError as exc:
            self._refuse(str(exc))
        previous = core.options
        if options == previous:
            return
        if core.is_running and previous is not None:
            for name in STARTUP_ONLY:
                if getattr(options, name) != getattr(previous, name):
                    self._refuse(f"{PREFIX}{name} is set when the gateway starts, never while it runs")
        changed = {
            f
            for f in GatewayOptions.__dataclass_fields__
            if previous is None or getattr(options, f) != getattr(previous, f)
        }
        writer, last_seq = core.writer, None
        if writer is None or changed & set(WRITER_OPTIONS):
            writer, last_seq = self._new_writer(options)
        engine = core.engine
        if engine is None or changed & set(ENGINE_OPTIONS):
            try:
                engine = EngineClient(
                    options.backend,
                    timeout=options.engine_timeout,
                    kind=options.engine,
                    tool_call_parser=options.tool_call_parser,
                )
            except (
                engine_keys.KeyFileError
            ) as exc:  # $POLAR_ENGINE_KEY_FILE unusable: one line, not a traceback
                self._refuse(str(exc))
        prompts = previous_prompts = core.prompts
        if prompts is None or changed & set(PROMPT_OPTIONS):
            prompts = PromptBuilder(
                options.prompt_mode, tokenizer=options.tokenizer, model_info=engine.model_info
            )
        gateway = Gateway(options, engine, writer, prompts, session_key=core.session_key)
        if last_seq is None and core.gateway is not None:
            gateway.continue_numbering(core.gateway)  # the same records folder: its numbering goes on
        elif last_seq:
            gateway.seed_sequences(last_seq)
        core.options, core.writer, core.engine, core.prompts, core.gateway = (
            options,
            writer,
            engine,
            prompts,
            gateway,
        )
        if prompts is not previous_prompts:  # a new prompt builder: load its renderer now, not on a call
            self._start_background()
        elif (
            previous is not None and "out" in changed
        ):  # a new records folder: the engine described in it too
            self._start_engine_record()

    def _refuse(self, message: str) -> NoReturn:
        if not self.core.is_running:
            stop_process(message)
        raise OptionsError(message)

    def _new_writer(self, options: GatewayOptions) -> tuple[RecordWriter, dict[str, int]]:
        """The journal writer for `options`, started, and the last seq of each session already in its folder."""
        out = Path(options.out)
        previous = self.core.writer
        if previous is not None and previous.out_dir.resolve() == out.resolve():
            previous.close()  # one writer per journal folder
            previous = None
        writer = RecordWriter(
            out,
            rotate_bytes=options.rotate_mb << 20,
            rotate_seconds=options.rotate_seconds,
            fsync=options.fsync,
        )
        try:
            writer.start()
        except OSError as exc:
            self._refuse(f"{PREFIX}out={options.out!r} cannot hold records: {exc}")
        if previous is not None:
            previous.close()
        # An unreadable shard is moved aside with its reason; it must never keep the gateway from serving.
        return writer, last_seq_by_session(out, on_unreadable=writer.quarantine_shard)

    # -- startup -------------------------------------------------------------------------------------------------

    def running(self) -> None:
        self.core.is_running = True
        # Never dial the real provider when a tunnel opens: model calls are answered here.
        if ctx.options.polar_passthrough == "block" and ctx.options.connection_strategy != "lazy":
            ctx.options.update(connection_strategy="lazy")
        warning = exposure_warning(
            ctx.options.mode, ctx.options.listen_host, ctx.options.proxyauth, ctx.options.listen_port
        )
        if warning:
            log.warning(warning)
        if self._warm_task is None:  # configure had no event loop to start it on
            self._start_background()

    def _start_background(self) -> None:
        """Load what the hot path needs (tokens mode's renderer) now, in a worker thread, and say when it is
        ready; describe the engine next to the records (what merge needs). Strong references: the event loop
        keeps only weak ones to its tasks."""
        core = self.core
        if core.engine is None or core.prompts is None or core.options is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # configured outside mitmproxy's loop (tests): the first call loads it
            return
        if self._warm_task is not None:
            self._warm_task.cancel()
        self._warm_task = loop.create_task(self._warm_up(core.prompts))
        self._start_engine_record()

    def _start_engine_record(self) -> None:
        """Write `<polar_out>/_engine.json` once the engine answers (engines/description.py)."""
        core = self.core
        if core.engine is None or core.prompts is None or core.options is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if core.engine_task is not None:
            core.engine_task.cancel()
        core.engine_task = loop.create_task(
            record_engine(
                Path(core.options.out),
                core.options.backend,
                core.engine.model_info,
                core.prompts.warm,
            )
        )

    async def _warm_up(self, prompts: PromptBuilder) -> None:
        await prompts.warm()
        ready, detail = prompts.readiness()
        if ready and prompts.engine_error is not None and self.core.options is not None:
            # Not "ready": a person reading this line would point a harness at a gateway whose every call fails.
            log.warning(
                "polar-mitm gateway up, but its engine %s does not answer (%s): every model call is refused "
                "until it does; start the engine or fix polar_backend",
                self.core.options.backend,
                prompts.engine_error,
            )
        elif ready:  # the line runners and people wait for (also answered at GET /_polar/ready)
            log.info("polar-mitm gateway ready, %.1f s after start: %s", time.monotonic() - STARTED, detail)
