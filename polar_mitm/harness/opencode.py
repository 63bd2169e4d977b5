"""opencode (`opencode-ai`, a Bun binary): its built-in `anthropic` provider (Messages, api.anthropic.com) in proxy
mode, an `@ai-sdk/openai-compatible` provider of ours (Chat Completions) in base-URL mode.

It asks the model for a session title on the side, and tries to npm-install its plugin package: npm is pointed
at a dead local registry. Bun takes NODE_EXTRA_CA_CERTS or SSL_CERT_FILE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import COMMAND, DEAD_PROXY, Harness, Hookup, ProviderName, Runtime, ShellTool

FIRST_PARTY_MODEL = "anthropic/claude-sonnet-4-5"


class OpenCode(Harness):
    name: ClassVar[str] = "opencode"
    package: ClassVar[str] = "opencode-ai"
    binary: ClassVar[str] = "opencode"
    runtime: ClassVar[Runtime] = "bun"
    api: ClassVar[ProviderName] = "anthropic"
    base_url_api: ClassVar[ProviderName | None] = "openai_chat"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (
        ShellTool("bash", {"command": COMMAND, "description": "Run the requested shell command"}),
    )

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        config = {"$schema": "https://opencode.ai/config.json", **opencode_config(hookup, FIRST_PARTY_MODEL)}
        return {".config/opencode/opencode.json": json.dumps(config, indent=2) + "\n"}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        return {"ANTHROPIC_API_KEY": hookup.api_key, "POLAR_API_KEY": hookup.api_key}

    def unattended_env(self) -> dict[str, str]:
        return {
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "npm_config_registry": DEAD_PROXY + "/",  # its plugin install fails at once, offline
        }

    def prompt_args(self, prompt: str) -> list[str]:
        return ["run", prompt]


def opencode_config(hookup: Hookup, first_party_model: str) -> dict:
    """opencode's config (and its forks', Kilo Code's): no updates or sharing; in proxy mode the first-party model,
    in base-URL mode an OpenAI-compatible provider at the gateway (its SDK is bundled: nothing is downloaded)."""
    config: dict = {"autoupdate": False, "share": "disabled"}
    if hookup.mode == "proxy":
        config["model"] = first_party_model
        return config
    config["model"] = "polar/polar-model"
    config["provider"] = {
        "polar": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "polar-mitm",
            "options": {"baseURL": hookup.base_url("/v1"), "apiKey": "{env:POLAR_API_KEY}"},
            "models": {"polar-model": {"name": "polar-model"}},
        }
    }
    return config
