"""Claude Code (`@anthropic-ai/claude-code`, a Bun binary): Anthropic Messages, to api.anthropic.com or a base URL.

Proxy mode shows its first-party request shape (deferred tools behind ToolSearch, extra betas, settings probes);
base-URL mode uses ANTHROPIC_BASE_URL. Runs as root only with IS_SANDBOX=1 (its container switch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import COMMAND, Harness, Hookup, ProviderName, Runtime, ShellTool


class ClaudeCode(Harness):
    name: ClassVar[str] = "claude-code"
    package: ClassVar[str] = "@anthropic-ai/claude-code"
    binary: ClassVar[str] = "claude"
    runtime: ClassVar[Runtime] = "bun"
    api: ClassVar[ProviderName] = "anthropic"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (
        ShellTool("Bash", {"command": COMMAND, "description": "Run the requested shell command"}),
    )

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        # Onboarding done: interactive runs start straight away (-p never asks).
        return {".claude.json": json.dumps({"hasCompletedOnboarding": True}, indent=2) + "\n"}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        env = {"ANTHROPIC_API_KEY": hookup.api_key, "CLAUDE_CONFIG_DIR": str(home / ".claude")}
        if hookup.mode == "base-url":
            env["ANTHROPIC_BASE_URL"] = hookup.base_url()
        return env

    def unattended_env(self) -> dict[str, str]:
        return {
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            # Also turns off the feedback survey, release notes and other calls home.
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            # --dangerously-skip-permissions refuses to run as root unless it is told it is in a sandbox.
            "IS_SANDBOX": "1",
        }

    def prompt_args(self, prompt: str) -> list[str]:
        return ["-p", prompt, "--output-format", "json", "--dangerously-skip-permissions"]
