"""Kilo Code CLI (npm `@kilocode/cli`, a Bun binary of its opencode fork): like opencode, its built-in `anthropic`
provider (Messages, api.anthropic.com) in proxy mode, an `@ai-sdk/openai-compatible` provider of ours (Chat
Completions) in base-URL mode.

Installed apart from the six npm CLIs (scripts/setup-kilo.sh → .harness-kilo/). Config in
`~/.config/kilo/kilo.json`; the opencode switches carry the KILO_ prefix. recipes/kilo.md.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import (
    COMMAND,
    DEAD_PROXY,
    REPO_ROOT,
    Harness,
    HarnessError,
    Hookup,
    ProviderName,
    Runtime,
    ShellTool,
)
from polar_mitm.harness.opencode import opencode_config

FIRST_PARTY_MODEL = "anthropic/claude-sonnet-4-5"
PREFIX_VARIABLE = "POLAR_KILO_PREFIX"


def prefix_dir() -> Path:
    """Where scripts/setup-kilo.sh installs it (POLAR_KILO_PREFIX moves it)."""
    return Path(os.environ.get(PREFIX_VARIABLE) or REPO_ROOT / ".harness-kilo")


class Kilo(Harness):
    name: ClassVar[str] = "kilo"
    package: ClassVar[str] = "@kilocode/cli"  # npm, pinned in scripts/setup-kilo.sh
    binary: ClassVar[str] = "kilo"
    runtime: ClassVar[Runtime] = "bun"
    api: ClassVar[ProviderName] = "anthropic"
    base_url_api: ClassVar[ProviderName | None] = "openai_chat"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (
        ShellTool("bash", {"command": COMMAND, "description": "Run the requested shell command"}),
    )

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        config = opencode_config(hookup, FIRST_PARTY_MODEL)  # a fork of opencode: the same config shape
        return {".config/kilo/kilo.json": json.dumps(config, indent=2) + "\n"}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        return {"ANTHROPIC_API_KEY": hookup.api_key, "POLAR_API_KEY": hookup.api_key}

    def unattended_env(self) -> dict[str, str]:
        switches = (
            "AUTOUPDATE",
            "DEFAULT_PLUGINS",
            "LSP_DOWNLOAD",
            "MODELS_FETCH",
            "SHARE",
            "CODEBASE_INDEXING",
            "SESSION_INGEST",
            "PRESENCE",
        )
        return {
            **{f"KILO_DISABLE_{switch}": "1" for switch in switches},
            "npm_config_registry": DEAD_PROXY + "/",  # a plugin install fails at once, offline
        }

    def prompt_args(self, prompt: str) -> list[str]:
        return ["run", prompt]

    def executable(self, bin_dir: Path | None = None) -> Path:
        """`kilo` under its own prefix, else on PATH."""
        candidate = prefix_dir() / "node_modules" / ".bin" / self.binary
        if candidate.exists():
            return candidate
        found = shutil.which(self.binary)
        if found:
            return Path(found)
        raise HarnessError(f"{self.binary} ({self.package}) is not installed: run scripts/setup-kilo.sh")

    def installed_version(self) -> str | None:
        manifest = prefix_dir() / "node_modules" / self.package / "package.json"
        return json.loads(manifest.read_text())["version"] if manifest.exists() else None
