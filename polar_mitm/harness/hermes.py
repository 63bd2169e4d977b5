"""Hermes Agent (PyPI `hermes-agent`, Nous Research; Python on the openai SDK): its built-in `openai-api` provider
(OpenAI Responses, api.openai.com) in proxy mode, its `custom` provider (Chat Completions) in base-URL mode.

Its own venv (scripts/setup-hermes.sh): hermes-agent pins its dependencies exactly (openai 2.24.0, httpx 0.28.1,
pydantic, rich, ...), which must not decide the project's versions. Everything it keeps (config.yaml, .env,
sessions, memories, skills, logs) lives under HERMES_HOME, which the preset puts inside the isolated HOME; the
provider is `model:` in `$HERMES_HOME/config.yaml`. A one-shot run is `hermes -z PROMPT` (approvals bypassed, only
the final answer on stdout). Its shell tool is `terminal {command}`. recipes/hermes.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import (
    COMMAND,
    Hookup,
    ProviderName,
    ShellTool,
    VenvHarness,
)

FIRST_PARTY = ("openai-api", "gpt-4.1-mini")  # api.openai.com: Hermes speaks Responses to that host
OURS = ("custom", "polar-model")  # any OpenAI-compatible endpoint: Chat Completions
# The toolsets a run offers: the shell and the file tools (a coding agent's), not the web, browser, image,
# memory and messaging tools of Hermes' default `hermes-cli` set, which would call out to other services.
TOOLSETS = "terminal,file"
# Given here, Hermes asks no one for the model's context length (else it probes the endpoint's and openrouter.ai's
# model lists); its compaction fires at 75% of it. The tiny engine's context, as in the Aider preset.
CONTEXT_LENGTH = 131072


class Hermes(VenvHarness):
    name: ClassVar[str] = "hermes"
    package: ClassVar[str] = "hermes-agent"  # PyPI, pinned in scripts/setup-hermes.sh
    binary: ClassVar[str] = "hermes"
    venv: ClassVar[str] = ".venv-hermes"
    venv_variable: ClassVar[str] = "POLAR_HERMES_VENV"
    setup_script: ClassVar[str] = "scripts/setup-hermes.sh"
    distribution: ClassVar[str] = "hermes_agent"
    api: ClassVar[ProviderName] = "openai_responses"
    base_url_api: ClassVar[ProviderName | None] = "openai_chat"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (ShellTool("terminal", {"command": COMMAND}),)

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        provider, model = FIRST_PARTY if hookup.mode == "proxy" else OURS
        model_config: dict[str, object] = {
            "provider": provider,
            "default": model,
            "context_length": CONTEXT_LENGTH,
        }
        if hookup.mode == "base-url":
            model_config.update(base_url=hookup.base_url("/v1"), api_key=hookup.api_key)
        config = {
            "model": model_config,
            "toolsets": TOOLSETS.split(","),
        }
        # JSON is YAML: no YAML writer needed in our venv.
        return {".hermes/config.yaml": json.dumps(config, indent=2) + "\n"}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        return {"HERMES_HOME": str(home / ".hermes"), "OPENAI_API_KEY": hookup.api_key}

    def unattended_env(self) -> dict[str, str]:
        return {
            "HERMES_YOLO_MODE": "1",  # no approval prompts for commands (-z sets it too)
            "HERMES_ACCEPT_HOOKS": "1",
            "HERMES_DISABLE_LAZY_INSTALLS": "1",  # never pip-install an optional dependency at run time
            "HERMES_SKIP_NODE_BOOTSTRAP": "1",  # never download Node for its browser tools
            "PYTHONUNBUFFERED": "1",
        }

    def prompt_args(self, prompt: str) -> list[str]:
        return ["-z", prompt, "--toolsets", TOOLSETS]
