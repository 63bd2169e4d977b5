"""Cline CLI (npm `cline`, a Bun binary in its platform package): its built-in `openai-native` provider (OpenAI
Responses, api.openai.com) in proxy mode, its `openai-compatible` provider (Chat Completions) in base-URL mode.

Installed apart from the six npm CLIs (scripts/setup-cline.sh → .harness-cline/). The provider lives in
`~/.cline/data/settings/providers.json` (the file `cline auth` writes, `lastUsedProvider` is what a run takes);
without it Cline falls back to its own `cline` provider (api.cline.bot, an account login). Its shell tool is
`run_commands {commands: [...]}`. recipes/cline.md.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import ClassVar

from polar_mitm.harness.base import (
    COMMAND,
    REPO_ROOT,
    Harness,
    HarnessError,
    Hookup,
    ProviderName,
    Runtime,
    ShellTool,
)

FIRST_PARTY = ("openai-native", "gpt-4.1-mini")  # api.openai.com
OURS = ("openai-compatible", "polar-model")
PREFIX_VARIABLE = "POLAR_CLINE_PREFIX"


def prefix_dir() -> Path:
    """Where scripts/setup-cline.sh installs it (POLAR_CLINE_PREFIX moves it)."""
    return Path(os.environ.get(PREFIX_VARIABLE) or REPO_ROOT / ".harness-cline")


class Cline(Harness):
    name: ClassVar[str] = "cline"
    package: ClassVar[str] = "cline"  # npm, pinned in scripts/setup-cline.sh
    binary: ClassVar[str] = "cline"
    runtime: ClassVar[Runtime] = "bun"
    api: ClassVar[ProviderName] = "openai_responses"
    base_url_api: ClassVar[ProviderName | None] = "openai_chat"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (ShellTool("run_commands", {"commands": [COMMAND]}),)

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        provider, model = FIRST_PARTY if hookup.mode == "proxy" else OURS
        settings = {"provider": provider, "apiKey": hookup.api_key, "model": model}
        if hookup.mode == "base-url":
            settings["baseUrl"] = hookup.base_url("/v1")
        providers = {
            "version": 1,
            "lastUsedProvider": provider,  # what a run without -P/-m takes
            "modes": {},
            # Without updatedAt the entry is not taken (seen with 3.0.65: it fell back to its `cline` provider).
            "providers": {
                provider: {
                    "settings": settings,
                    "updatedAt": "2026-01-01T00:00:00.000Z",
                    "tokenSource": "manual",
                }
            },
        }
        return {".cline/data/settings/providers.json": json.dumps(providers, indent=2) + "\n"}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        return {"OPENAI_API_KEY": hookup.api_key}

    def prompt_args(self, prompt: str) -> list[str]:
        # --retries 1: a failed call is not retried for a minute of back-off.
        return ["--json", "--retries", "1", prompt]

    def executable(self, bin_dir: Path | None = None) -> Path:
        """`cline` under its own prefix, else on PATH."""
        candidate = prefix_dir() / "node_modules" / ".bin" / self.binary
        if candidate.exists():
            return candidate
        found = shutil.which(self.binary)
        if found:
            return Path(found)
        raise HarnessError(f"{self.binary} ({self.package}) is not installed: run scripts/setup-cline.sh")

    def installed_version(self) -> str | None:
        manifest = prefix_dir() / "node_modules" / self.package / "package.json"
        return json.loads(manifest.read_text())["version"] if manifest.exists() else None
