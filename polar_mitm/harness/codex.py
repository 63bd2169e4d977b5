"""Codex CLI (`@openai/codex`, a Rust binary behind a Node launcher): OpenAI Responses, `store: false`.

Proxy mode uses the built-in `openai` provider (api.openai.com, the first-party shape); base-URL mode a custom
`[model_providers.polar]`. Rust's TLS reads only SSL_CERT_FILE. The Responses WebSocket, remote model lists and
plugins are switched off in config.toml (the gateway also answers a WebSocket upgrade with 426 so that a Codex
that still tries falls back to HTTPS at once).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import COMMAND, Harness, Hookup, ProviderName, Runtime, ShellTool

MODEL = "gpt-5.5"  # a slug in Codex's bundled model catalogue, so it needs no remote model list


def toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class Codex(Harness):
    name: ClassVar[str] = "codex"
    package: ClassVar[str] = "@openai/codex"
    binary: ClassVar[str] = "codex"
    runtime: ClassVar[Runtime] = "rust"
    api: ClassVar[ProviderName] = "openai_responses"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (
        ShellTool("exec_command", {"cmd": COMMAND}),  # unified exec (current default)
        ShellTool("shell", {"command": ["bash", "-lc", COMMAND]}),  # the classic shell tool
        ShellTool("shell_command", {"command": COMMAND}),
    )

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        lines = [
            f"model = {toml_string(MODEL)}",
            'approval_policy = "never"',
            # The harness runs unattended in a throwaway workspace (and, in tests, a private network namespace).
            'sandbox_mode = "danger-full-access"',
            "check_for_update_on_startup = false",
        ]
        if hookup.mode == "base-url":
            lines += [
                'model_provider = "polar"',
                "",
                "[model_providers.polar]",
                'name = "polar-mitm"',
                f"base_url = {toml_string(hookup.base_url('/v1'))}",
                'wire_api = "responses"',
                'env_key = "POLAR_API_KEY"',
                "supports_websockets = false",
            ]
        lines += [
            "",
            "[features]",
            "plugins = false",
            "responses_websockets = false",
            "responses_websockets_v2 = false",
            "remote_models = false",
            "api_key_model_discovery = false",
            "",
            "[analytics]",
            "enabled = false",
        ]
        return {".codex/config.toml": "\n".join(lines) + "\n"}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        key = hookup.api_key
        return {
            "CODEX_HOME": str(home / ".codex"),
            "CODEX_API_KEY": key,
            "OPENAI_API_KEY": key,
            "POLAR_API_KEY": key,
        }

    def prompt_args(self, prompt: str) -> list[str]:
        return ["exec", "--skip-git-repo-check", "--json", prompt]
