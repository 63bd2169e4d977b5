"""Gemini CLI (`@google/gemini-cli`, Node): Google GenerateContent, to generativelanguage.googleapis.com or a base URL.

Besides the main turns it asks a routing classifier (a JSON-mode `generateContent` on a lite model) which model
should answer; the scripted policy answers that in JSON. Node reads only NODE_EXTRA_CA_CERTS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import COMMAND, Harness, Hookup, ProviderName, Runtime, ShellTool


class GeminiCli(Harness):
    name: ClassVar[str] = "gemini"
    package: ClassVar[str] = "@google/gemini-cli"
    binary: ClassVar[str] = "gemini"
    runtime: ClassVar[Runtime] = "node"
    api: ClassVar[ProviderName] = "google"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (ShellTool("run_shell_command", {"command": COMMAND}),)

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        settings = {
            "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "security": {"auth": {"selectedType": "gemini-api-key"}},
        }
        return {".gemini/settings.json": json.dumps(settings, indent=2) + "\n"}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        env = {"GEMINI_API_KEY": hookup.api_key}
        if hookup.mode == "base-url":
            env["GOOGLE_GEMINI_BASE_URL"] = hookup.base_url()
        return env

    def unattended_env(self) -> dict[str, str]:
        return {"GEMINI_CLI_TRUST_WORKSPACE": "true", "GEMINI_TELEMETRY_ENABLED": "false"}

    def prompt_args(self, prompt: str) -> list[str]:
        return ["-p", prompt, "--yolo"]
