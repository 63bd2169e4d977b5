"""Pi (`@mariozechner/pi-coding-agent`, Node): its built-in `openai` provider (Responses, api.openai.com) in proxy
mode, a `polar` provider of ours (Chat Completions, `~/.pi/agent/models.json`) in base-URL mode.

PI_OFFLINE turns off every startup network call (update and package checks, install telemetry).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import COMMAND, Harness, Hookup, ProviderName, Runtime, ShellTool

FIRST_PARTY = ("openai", "gpt-5.1-codex")
OURS = ("polar", "polar-model")


class Pi(Harness):
    name: ClassVar[str] = "pi"
    package: ClassVar[str] = "@mariozechner/pi-coding-agent"
    binary: ClassVar[str] = "pi"
    runtime: ClassVar[Runtime] = "node"
    api: ClassVar[ProviderName] = "openai_responses"
    base_url_api: ClassVar[ProviderName | None] = "openai_chat"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (ShellTool("bash", {"command": COMMAND}),)

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        provider, model = FIRST_PARTY if hookup.mode == "proxy" else OURS
        settings = {"defaultProvider": provider, "defaultModel": model, "enableInstallTelemetry": False}
        files = {".pi/agent/settings.json": json.dumps(settings, indent=2) + "\n"}
        if hookup.mode == "base-url":
            models = {
                "providers": {
                    provider: {
                        "baseUrl": hookup.base_url("/v1"),
                        "api": "openai-completions",
                        "apiKey": "POLAR_API_KEY",  # the name of the variable that holds it
                        # SGLang-style servers: a system message rather than `developer`, no reasoning_effort.
                        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
                        "models": [
                            {"id": model, "reasoning": True, "contextWindow": 131072, "maxTokens": 8192}
                        ],
                    }
                }
            }
            files[".pi/agent/models.json"] = json.dumps(models, indent=2) + "\n"
        return files

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        return {
            "PI_CODING_AGENT_DIR": str(home / ".pi" / "agent"),
            "OPENAI_API_KEY": hookup.api_key,
            "POLAR_API_KEY": hookup.api_key,
        }

    def unattended_env(self) -> dict[str, str]:
        return {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"}

    def prompt_args(self, prompt: str) -> list[str]:
        return ["-p", prompt]
